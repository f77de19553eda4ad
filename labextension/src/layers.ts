/**
 * The line a kernel row shows about its layers: "hard limit 40 GiB (MPS)" when the driver enforces a
 * limit at allocation time, "soft cap only: <why>" when the server's hard limits are on but this
 * kernel has none. Nothing when the server's hard limits are off: the row stays as it always was.
 * Pure: no JupyterLab imports, so the unit tests run in plain Node.
 */

import { IKernelLayers, IReason } from './contract';
import { formatBytes, reasonText } from './format';

export interface ILayersLine {
  text: string;
  title: string;
  hard: boolean;
}

/** The part of a TranslationBundle this module uses. */
export interface ITranslate {
  __(msgid: string, ...args: any[]): string;
}

const byIndex = (a: string, b: string): number => Number(a) - Number(b);

/** `reason`: the server's short words for `hard_reason` (the kernel's reasons.hard_limit), when it sent them. */
export function layersLine(
  layers: IKernelLayers | null | undefined,
  trans: ITranslate,
  reason?: IReason | null
): ILayersLine | null {
  if (!layers || !layers.hard_cap || layers.hard_cap === 'off' || layers.soft === false) {
    return null;
  }
  const limits = layers.hard_limit?.mps || {};
  const usable = layers.hard_usable || {};
  const indexes = Object.keys(limits).sort(byIndex);
  if (indexes.length) {
    // One figure when every device has the same limit (the usual case); else one per device.
    const amounts = Array.from(new Set(indexes.map(i => formatBytes(usable[i] ?? limits[i]))));
    let text = trans.__('hard limit %1 (MPS)', amounts.join(', '));
    if (layers.restart_needed) {
      text += trans.__('; a higher cap applies after a restart');
    }
    const lines = [
      trans.__(
        'The driver refuses any allocation past the limit, whatever library makes it (limit with the CUDA context: %1).',
        indexes.map(i => trans.__('GPU %1 %2', i, formatBytes(limits[i]))).join(', ')
      )
    ];
    return { text, title: lines.join('\n'), hard: true };
  }
  const why = reasonText(reason, layers.hard_reason);
  const title = [
    trans.__(
      'Caps inside the kernel (torch, CuPy, JAX) and the watchdog apply; the driver enforces no hard limit for this kernel.'
    )
  ];
  if (why && why.detail !== why.words) {
    title.push(why.detail);
  }
  return {
    text: trans.__('soft cap only: %1', why?.words || trans.__('no reason given')),
    title: title.join('\n'),
    hard: false
  };
}
