/**
 * One GPU of the server, above the kernels: its name, a bar and its figures. The bar shows what NVML
 * measures as used when it can, else what is granted to kernels, and its tooltip says which: the two
 * differ, and a granted bar that looked like usage would mislead.
 */

import { TranslationBundle } from '@jupyterlab/translation';

import { Bar } from './bar';
import { IDeviceStatus } from './contract';
import { barFraction, usageLevel } from './derive';
import { h, setAttr, setText } from './dom';
import { formatBytes, formatPair } from './format';

export class DeviceRow {
  readonly node = h('div', 'jp-GpuQuota-device');
  private _name = h('div', 'jp-GpuQuota-deviceName');
  private _granted = new Bar();
  private _figures = h('div', 'jp-GpuQuota-figures');
  constructor(private _trans: TranslationBundle) {
    this.node.append(this._name, this._granted.node, this._figures);
  }
  update(device: IDeviceStatus, threshold: number): void {
    const trans = this._trans;
    setText(this._name, trans.__('GPU %1 · %2', device.index, device.name));
    const hasUsed = typeof device.used === 'number';
    const shown = hasUsed ? (device.used as number) : device.granted;
    this._granted.set(barFraction(shown, device.total), usageLevel(shown, device.total, threshold));
    const parts = [trans.__('granted %1', formatPair(device.granted, device.total))];
    if (hasUsed) {
      parts.push(trans.__('used %1', formatBytes(device.used)));
    }
    parts.push(trans._n('%1 kernel', '%1 kernels', device.kernels));
    setText(this._figures, parts.join(' · '));
    setAttr(
      this._granted.node,
      'title',
      hasUsed
        ? trans.__('Bar: memory used on this GPU (NVML) against its total')
        : trans.__('Bar: memory granted to kernels on this GPU against its total')
    );
  }
}
