/**
 * The key to the kernels' charts, once above the kernel list rather than under every chart: what each line
 * and band is. The marks that not every chart has (the hard limit, the park bands) are listed only while
 * some row's chart draws them, so the key never explains what is nowhere on screen.
 */

import { TranslationBundle } from '@jupyterlab/translation';

import { h, setHidden } from './dom';

/** Which of the marks that not every chart has a row's chart draws now. */
export interface IChartMarks {
  hardLimit: boolean;
  park: boolean;
  waiting: boolean;
  lost: boolean;
}

export const NO_MARKS: IChartMarks = { hardLimit: false, park: false, waiting: false, lost: false };

export class ChartLegend {
  readonly node = h('div', 'jp-GpuQuota-legend');
  private _entries = new Map<string, HTMLElement>();
  constructor(trans: TranslationBundle) {
    const entries: [string, string][] = [
      ['allocated', trans.__('allocated')],
      ['reserved', trans.__('reserved')],
      ['used', trans.__('used (NVML)')],
      ['cap', trans.__('cap')],
      ['hardLimit', trans.__('hard limit')],
      ['park', trans.__('parked')],
      ['waiting', trans.__('waiting to resume')],
      ['lost', trans.__('lost')]
    ];
    for (const [mark, words] of entries) {
      const entry = h('span', `jp-GpuQuota-legendEntry jp-GpuQuota-legend-${mark}`);
      entry.append(h('span', 'jp-GpuQuota-legendMark'), document.createTextNode(words));
      this._entries.set(mark, entry);
      this.node.append(entry);
    }
    this.node.setAttribute('aria-hidden', 'true'); // each chart says its own in words
  }
  update(marks: IChartMarks): void {
    setHidden(this._entries.get('hardLimit')!, !marks.hardLimit);
    setHidden(this._entries.get('park')!, !marks.park);
    setHidden(this._entries.get('waiting')!, !marks.waiting);
    setHidden(this._entries.get('lost')!, !marks.lost);
  }
}
