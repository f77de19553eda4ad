/**
 * The status bar item: the current kernel's GPU usage against its cap ("GPU 3.2 / 10 GiB", "GPU unknown /
 * 10 GiB" when nothing measures it), in the warning colour from the threshold on. Hidden when the current
 * kernel has no grant.
 */

import { TranslationBundle } from '@jupyterlab/translation';
import { Message } from '@lumino/messaging';
import { ISignal, Signal } from '@lumino/signaling';
import { Widget } from '@lumino/widgets';

import { monitorNotice, statusBarInfo, usagePair } from './derive';
import { formatBytes, labelled } from './format';
import { QuotaModel } from './model';
import { IState } from './state';
import { monitorNoticeText, usageTooltip } from './usageText';

export class QuotaStatusItem extends Widget {
  constructor(
    private _model: QuotaModel,
    private _trans: TranslationBundle,
    public threshold = 0.9
  ) {
    super();
    this.addClass('jp-GpuQuota-status');
    this._text.className = 'jp-StatusBar-TextItem';
    this.node.appendChild(this._text);
    this.node.setAttribute('role', 'status');
    _model.changed.connect(this._onChanged, this);
    this._onChanged(_model, _model.state);
  }

  /** Emits when the item starts or stops having something to show (for the status bar's isActive). */
  get activeChanged(): ISignal<this, void> {
    return this._activeChanged;
  }

  get active(): boolean {
    return this._active;
  }

  dispose(): void {
    if (this.isDisposed) {
      return;
    }
    this._model.changed.disconnect(this._onChanged, this);
    Signal.clearData(this);
    super.dispose();
  }

  protected onAfterShow(msg: Message): void {
    void this._model.refresh();
  }

  private _onChanged(sender: QuotaModel, state: IState): void {
    const trans = this._trans;
    const info = statusBarInfo(state, this.threshold);
    const active = info !== null;
    if (info) {
      let text: string;
      let title: string;
      const notice = monitorNotice(state.status);
      if (info.device && info.usage) {
        text = trans.__('GPU %1', usagePair(info.usage, info.device.cap));
        title = usageTooltip(trans, info.device, info.usage);
      } else {
        text = trans.__('GPU: CPU only');
        title = info.kernel.cpu_only_reason || trans.__('This kernel was given no GPU');
      }
      if (notice) {
        title += '\n' + monitorNoticeText(trans, notice);
      }
      if (state.phase === 'error') {
        title += '\n' + labelled(trans.__('Last poll failed'), state.error);
      }
      if (this._text.textContent !== text) {
        this._text.textContent = text;
      }
      this.node.title = title;
      this.node.dataset.level = info.level;
      this.node.classList.toggle('jp-mod-warning', info.level === 'warning');
      this.node.classList.toggle('jp-mod-over', info.level === 'over');
      this.node.classList.toggle('jp-mod-stalled', notice?.problem === 'stalled');
      this.node.classList.toggle('jp-mod-unknown', info.usage !== null && info.usage.bytes === null);
      this.node.dataset.used = info.usage ? formatBytes(info.usage.bytes) : '';
    }
    if (active !== this._active) {
      this._active = active;
      this._activeChanged.emit();
    }
  }

  private _text = document.createElement('span');
  private _active = false;
  private _activeChanged = new Signal<this, void>(this);
}
