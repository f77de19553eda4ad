/**
 * The words about GPU usage that the sidebar and the status bar share: the banner about the server's GPU
 * monitor, where a usage figure comes from, and the tooltip of a kernel's figure on one GPU. Here, not in
 * the panel, so that the status bar reads them without importing the sidebar; here, not in format.ts,
 * because they are translated (format.ts has no JupyterLab imports).
 */

import { TranslationBundle } from '@jupyterlab/translation';

import { IKernelDevice } from './contract';
import { IMonitorNotice, IUsage, UsageSource } from './derive';
import { formatBytes, labelled } from './format';

/** The banner about the server's GPU monitor: what is wrong, in the server's words after it. */
export function monitorNoticeText(trans: TranslationBundle, notice: IMonitorNotice): string {
  switch (notice.problem) {
    case 'stalled':
      return labelled(trans.__('GPU monitor stalled, usage unknown'), notice.message);
    case 'error':
      return labelled(trans.__('GPU usage cannot be read'), notice.message);
    case 'unmeasured':
      return labelled(trans.__('GPU usage is not measured'), notice.message);
    default:
      return labelled(trans.__('Some GPUs cannot be read'), notice.message);
  }
}

export function sourceText(trans: TranslationBundle, source: UsageSource): string {
  switch (source) {
    case 'nvml':
      return trans.__('used by the whole process, measured by NVML');
    case 'allocator':
      return trans.__('reserved by the PyTorch allocator, reported by the kernel');
    default:
      return trans.__('unknown: NVML cannot read this GPU and the kernel has reported no allocator figures');
  }
}

export function usageTooltip(
  trans: TranslationBundle,
  device: IKernelDevice,
  usage: IUsage,
  unknownWhy = ''
): string {
  const lines = [
    usage.bytes === null
      ? trans.__('GPU %1: usage unknown, cap %2', device.index, formatBytes(device.cap))
      : trans.__('GPU %1: %2 of a %3 cap', device.index, formatBytes(usage.bytes), formatBytes(device.cap)),
    trans.__('Usage: %1', sourceText(trans, usage.source))
  ];
  if (usage.bytes === null && unknownWhy) {
    lines.push(unknownWhy);
  }
  if (typeof device.peak === 'number') {
    lines.push(trans.__('Peak (allocator): %1', formatBytes(device.peak)));
  }
  if (typeof device.max_cap === 'number') {
    lines.push(trans.__('Most this kernel may ask for: %1', formatBytes(device.max_cap)));
  }
  return lines.join('\n');
}
