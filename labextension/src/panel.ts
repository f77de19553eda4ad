/**
 * The "GPU quota" sidebar: the server's GPUs (deviceRow.ts), then its kernels (kernelRow.ts), the current
 * notebook's first and highlighted, with the key to their charts above them (chartLegend.ts) and one line
 * about the poll or the GPU monitor at the top (panelMessage.ts). This module is the widget and its
 * wiring: it follows the model, renders on change (once per animation frame, and only while shown), keeps
 * one row per kernel id across polls and tells each row whether it is in view. Plain DOM, updated in
 * place: a poll with 200 kernels touches only the figures that changed.
 */

import { TranslationBundle } from '@jupyterlab/translation';
import { Message } from '@lumino/messaging';
import { Widget } from '@lumino/widgets';

import { ChartLegend } from './chartLegend';
import { monitorNotice, sortKernels } from './derive';
import { DeviceRow } from './deviceRow';
import { h, setAttr, setHidden, setLevel, setText } from './dom';
import { IRowView, KernelRow } from './kernelRow';
import { QuotaModel } from './model';
import { IPanelActions } from './panelActions';
import { panelMessage } from './panelMessage';
import { IState } from './state';
import { monitorNoticeText } from './usageText';

export const PANEL_ID = 'gpu-quota-ext-panel';

export class QuotaPanel extends Widget {
  /** The last render durations in ms (script time), newest last: read by the benchmark. */
  readonly renderTimes: number[] = [];

  constructor(
    private _model: QuotaModel,
    private _trans: TranslationBundle,
    private _actions: IPanelActions,
    public threshold = 0.9
  ) {
    super();
    const trans = _trans;
    this.id = PANEL_ID;
    this.addClass('jp-GpuQuota-panel');
    this.title.caption = trans.__('GPU quota');
    const header = h('header', 'jp-GpuQuota-header', trans.__('GPU quota'));
    this._devicesTitle = h('h3', 'jp-GpuQuota-sectionTitle', trans.__('GPUs'));
    this._kernelsTitle = h('h3', 'jp-GpuQuota-sectionTitle');
    this._legend = new ChartLegend(trans);
    this._kernelList.setAttribute('aria-label', trans.__('Kernels'));
    this._message.setAttribute('role', 'status');
    this.node.append(
      header,
      this._message,
      this._devicesTitle,
      this._deviceList,
      this._kernelsTitle,
      this._legend.node,
      this._kernelList
    );
    if (typeof IntersectionObserver !== 'undefined') {
      this._observer = new IntersectionObserver(entries => this._onRowsSeen(entries), {
        root: this.node,
        rootMargin: '300px 0px'
      });
    }
    _model.changed.connect(this._onChanged, this);
    this._render(_model.state);
  }

  dispose(): void {
    if (this.isDisposed) {
      return;
    }
    this._observer?.disconnect();
    this._model.changed.disconnect(this._onChanged, this);
    super.dispose();
  }

  /** Rows that come into view draw the chart they skipped while out of it. */
  private _onRowsSeen(entries: IntersectionObserverEntry[]): void {
    let stale = false;
    for (const entry of entries) {
      const row = this._rowsByNode.get(entry.target);
      if (row) {
        row.inView = entry.isIntersecting;
        stale = stale || (row.inView && row.chartStale);
      }
    }
    if (stale) {
      this.update();
    }
  }

  /** Render now (the benchmark calls this to time one update). */
  renderNow(): number {
    return this._render(this._model.state);
  }

  protected onUpdateRequest(msg: Message): void {
    this._render(this._model.state);
  }

  protected onAfterShow(msg: Message): void {
    this.update();
    void this._model.refresh();
  }

  private _onChanged(): void {
    if (this.isVisible) {
      this.update(); // coalesced to one render per animation frame
    } else {
      this._stale = true;
    }
  }

  private _render(state: IState): number {
    const start = performance.now();
    this._stale = false;
    const trans = this._trans;
    const status = state.phase === 'missing' || state.phase === 'no-gpu' ? null : state.status;
    const notice = monitorNotice(status);
    const message = panelMessage(trans, state, notice);
    setHidden(this._message, !message.text);
    setText(this._message, message.text);
    setAttr(this._message, 'title', message.title);
    setLevel(this._message, message.level);
    setAttr(this._message, 'data-monitor', message.monitor);
    const devices = status ? status.devices : [];
    const kernels = status ? sortKernels(status.kernels, state.currentKernelId) : [];
    setHidden(this._devicesTitle, !status);
    setHidden(this._deviceList, !status);
    setHidden(this._kernelsTitle, !status);
    setHidden(this._kernelList, !status);
    const charted = kernels.some(k => (state.history.kernels[k.id] || []).length > 0);
    setHidden(this._legend.node, !status || !charted);

    // GPUs: few, rebuilt only when their number changes.
    if (this._deviceRows.length !== devices.length) {
      this._deviceRows = devices.map(() => new DeviceRow(trans));
      this._deviceList.replaceChildren(...this._deviceRows.map(r => r.node));
    }
    devices.forEach((device, i) => this._deviceRows[i].update(device, this.threshold));

    // Kernels: one row per kernel id, kept across polls; moved only when the order changes.
    setText(
      this._kernelsTitle,
      kernels.length
        ? trans.__('Kernels (%1)', kernels.length)
        : trans.__('Kernels: none running')
    );
    const view: IRowView = {
      threshold: this.threshold,
      now: Date.now(),
      unknownWhy: notice ? monitorNoticeText(trans, notice) : '',
      history: state.history
    };
    const seen = new Set<string>();
    const ordered: KernelRow[] = [];
    for (const kernel of kernels) {
      let row = this._kernelRows.get(kernel.id);
      if (!row) {
        row = new KernelRow(kernel, trans, this._actions);
        this._rowsByNode.set(row.node, row);
        this._observer?.observe(row.node);
        this._kernelRows.set(kernel.id, row);
      }
      row.update(kernel, kernel.id === state.currentKernelId, view);
      seen.add(kernel.id);
      ordered.push(row);
    }
    for (const [id, row] of this._kernelRows) {
      if (!seen.has(id)) {
        row.node.remove();
        this._observer?.unobserve(row.node);
        this._rowsByNode.delete(row.node);
        this._kernelRows.delete(id);
      }
    }
    this._legend.update({
      hardLimit: ordered.some(row => row.marks.hardLimit),
      park: ordered.some(row => row.marks.park),
      waiting: ordered.some(row => row.marks.waiting),
      lost: ordered.some(row => row.marks.lost)
    });
    let cursor = this._kernelList.firstElementChild;
    for (const row of ordered) {
      if (cursor === row.node) {
        cursor = cursor.nextElementSibling;
      } else {
        this._kernelList.insertBefore(row.node, cursor);
      }
    }
    const elapsed = performance.now() - start;
    this.renderTimes.push(elapsed);
    if (this.renderTimes.length > 500) {
      this.renderTimes.shift();
    }
    return elapsed;
  }

  /** Whether a change arrived while hidden (rendered on show). */
  get stale(): boolean {
    return this._stale;
  }

  private _stale = false;
  private _message = h('div', 'jp-GpuQuota-message');
  private _devicesTitle: HTMLElement;
  private _deviceList = h('div', 'jp-GpuQuota-devices');
  private _deviceRows: DeviceRow[] = [];
  private _kernelsTitle: HTMLElement;
  private _legend: ChartLegend;
  private _kernelList = h('ul', 'jp-GpuQuota-kernels');
  private _kernelRows = new Map<string, KernelRow>();
  private _rowsByNode = new Map<Element, KernelRow>();
  private _observer: IntersectionObserver | null = null;
}
