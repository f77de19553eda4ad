/**
 * A usage bar (a GPU's, a kernel's on one GPU): a track and a fill, with the meter's ARIA figures, or a
 * hatched track when nothing measures the usage, so that "unknown" never reads as an empty (0) bar.
 */

import { h, setAttr, setLevel } from './dom';

export class Bar {
  readonly node = h('div', 'jp-GpuQuota-bar');
  private _fill = h('div', 'jp-GpuQuota-barFill');
  private _width = '';
  constructor() {
    this.node.appendChild(this._fill);
    setAttr(this.node, 'role', 'meter');
  }
  set(fraction: number, level: string): void {
    // A transform, not a width: the compositor redraws the bar without a layout of the panel.
    const width = fraction.toFixed(3);
    if (width !== this._width) {
      this._width = width;
      this._fill.style.transform = `scaleX(${width})`;
      setAttr(this.node, 'aria-valuenow', String(Math.round(fraction * 100)));
    }
    setLevel(this._fill, level);
    this._setUnknown(false);
  }

  /** No figure: a hatched track with no fill, not an empty (0) bar. */
  setUnknown(words: string): void {
    this._width = '';
    this._fill.style.transform = 'scaleX(0)';
    this.node.removeAttribute('aria-valuenow');
    setAttr(this.node, 'aria-valuetext', words);
    this._setUnknown(true);
  }

  private _setUnknown(unknown: boolean): void {
    if (this.node.classList.contains('jp-mod-unknown') !== unknown) {
      this.node.classList.toggle('jp-mod-unknown', unknown);
      if (!unknown) {
        this.node.removeAttribute('aria-valuetext');
      }
    }
  }
}
