/**
 * A kernel's usage on one of its GPUs, inside its row: a label, a bar against the kernel's cap and the
 * figure. A figure nothing measures shows as unknown (a hatched bar), and the tooltip says why, in the
 * monitor's words, and where a known figure came from (NVML or the kernel's allocator).
 */

import { TranslationBundle } from '@jupyterlab/translation';

import { Bar } from './bar';
import { IKernelDevice } from './contract';
import { barFraction, kernelDeviceUsage, usageLevel, usagePair } from './derive';
import { h, setAttr, setText } from './dom';
import { usageTooltip } from './usageText';

export class KernelDeviceRow {
  readonly node = h('div', 'jp-GpuQuota-kernelDevice');
  private _label = h('span', 'jp-GpuQuota-kernelDeviceLabel');
  private _bar = new Bar();
  private _figure = h('span', 'jp-GpuQuota-figure');
  constructor(private _trans: TranslationBundle) {
    this.node.append(this._label, this._bar.node, this._figure);
  }
  update(device: IKernelDevice, threshold: number, unknownWhy: string): void {
    const trans = this._trans;
    const usage = kernelDeviceUsage(device);
    setText(this._label, trans.__('GPU %1', device.index));
    if (usage.bytes === null) {
      this._bar.setUnknown(trans.__('usage unknown'));
    } else {
      this._bar.set(barFraction(usage.bytes, device.cap), usageLevel(usage.bytes, device.cap, threshold));
    }
    setText(this._figure, usagePair(usage, device.cap));
    this.node.classList.toggle('jp-mod-unknown', usage.bytes === null);
    setAttr(this.node, 'title', usageTooltip(trans, device, usage, unknownWhy));
  }
}
