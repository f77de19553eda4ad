/**
 * The "GPU quota" sidebar: the server's GPUs, then its kernels (the current notebook's first and
 * highlighted), each with a bar of usage against cap (or "unknown", never a 0 bar), a chart of its usage
 * over the last minutes, one line about itself (its park state, or the one reason it cannot park or has
 * no GPU, the raw detail on hover), the last watchdog action, a cap field and its buttons, which wrap
 * rather than overflow a narrow sidebar. Plain DOM with one persistent element per kernel, updated in
 * place: a poll with 200 kernels touches only the figures that changed.
 */

import { TranslationBundle } from '@jupyterlab/translation';
import { Message } from '@lumino/messaging';
import { Widget } from '@lumino/widgets';

import { ICapResult, IParkResult } from './api';
import { chartOf } from './chart';
import { UsageChart } from './chartView';
import { IDeviceStatus, IKernelDevice, IKernelStatus } from './contract';
import {
  barFraction,
  IKernelLine,
  IMonitorNotice,
  IParkButton,
  IUsage,
  kernelDeviceUsage,
  kernelLine,
  monitorNotice,
  offersCap,
  parkButtons,
  parkFeedback,
  sortKernels,
  UsageSource,
  usageLevel,
  usagePair
} from './derive';
import { formatAge, formatBytes, formatPair, labelled, notParkableText, reasonText } from './format';
import { layersLine } from './layers';
import { QuotaModel } from './model';
import { IHistory, IState } from './state';

export const PANEL_ID = 'gpu-quota-ext-panel';

/** The shortest window a chart shows (seconds). */
const MIN_CHART_SECONDS = 60;

export interface IPanelActions {
  setCap(
    kernelId: string,
    request: { cap: string } | { reset: true }
  ): Promise<ICapResult>;
  /** POST kernels/<id>/park or /resume (shared/contract.py: PARK_SUFFIX, RESUME_SUFFIX). */
  park(kernelId: string, action: 'park' | 'resume'): Promise<IParkResult>;
  /** Resolves true when the kernel was shut down (false: the user cancelled). */
  shutdown(kernel: IKernelStatus): Promise<boolean>;
  open(path: string): void;
}

function h<K extends keyof HTMLElementTagNameMap>(
  tag: K,
  className: string,
  text?: string
): HTMLElementTagNameMap[K] {
  const node = document.createElement(tag);
  node.className = className;
  if (text !== undefined) {
    node.textContent = text;
  }
  return node;
}

function setText(node: HTMLElement, text: string): void {
  if (node.textContent !== text) {
    node.textContent = text;
  }
}

function setAttr(node: HTMLElement, name: string, value: string): void {
  if (node.getAttribute(name) !== value) {
    node.setAttribute(name, value);
  }
}

function setHidden(node: HTMLElement, hidden: boolean): void {
  if (node.hidden !== hidden) {
    node.hidden = hidden;
  }
}

/** A Park or Resume button as parkButtons() decided: shown or not, enabled or not, its tooltip. */
function setButton(button: HTMLButtonElement, wanted: IParkButton, busy: boolean): void {
  setHidden(button, !wanted.visible);
  const disabled = busy || !wanted.enabled;
  if (button.disabled !== disabled) {
    button.disabled = disabled;
  }
  setAttr(button, 'title', wanted.title);
}

const LEVEL_CLASSES = ['jp-mod-ok', 'jp-mod-warning', 'jp-mod-over'];

function setLevel(node: HTMLElement, level: string): void {
  const wanted = `jp-mod-${level}`;
  if (!node.classList.contains(wanted)) {
    node.classList.remove(...LEVEL_CLASSES);
    node.classList.add(wanted);
  }
}

/** A bar: a track and a fill whose width is a percentage. */
class Bar {
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

class DeviceRow {
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

class KernelDeviceRow {
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

class KernelRow {
  readonly node = h('li', 'jp-GpuQuota-kernel');
  readonly id: string;
  private _path = h('a', 'jp-GpuQuota-path');
  private _spec = h('span', 'jp-GpuQuota-spec');
  private _devices = h('div', 'jp-GpuQuota-kernelDevices');
  private _deviceRows: KernelDeviceRow[] = [];
  private _deviceKey = '';
  private _chart: UsageChart;
  private _layers = h('div', 'jp-GpuQuota-layers');
  private _line = h('div', 'jp-GpuQuota-line');
  private _action = h('div', 'jp-GpuQuota-action');
  private _parkButton = h('button', 'jp-GpuQuota-button jp-GpuQuota-parkButton');
  private _resumeButton = h('button', 'jp-GpuQuota-button jp-GpuQuota-resumeButton');
  private _parkBusy = false;
  /** The park state a Park / Resume answer spoke of: its feedback goes once the state has moved on. */
  private _feedbackPark: string | null = null;
  private _capGroup = h('div', 'jp-GpuQuota-capGroup');
  private _capInput = h('input', 'jp-GpuQuota-capInput');
  private _setButton = h('button', 'jp-GpuQuota-button jp-GpuQuota-setCap jp-mod-accept');
  private _resetButton = h('button', 'jp-GpuQuota-button jp-GpuQuota-reset');
  private _shutdownButton = h('button', 'jp-GpuQuota-button jp-GpuQuota-shutdown jp-mod-warn');
  private _feedback = h('div', 'jp-GpuQuota-feedback');
  private _kernel: IKernelStatus | null = null;

  constructor(
    kernel: IKernelStatus,
    private _trans: TranslationBundle,
    private _actions: IPanelActions
  ) {
    const trans = _trans;
    this.id = kernel.id;
    this.node.dataset.kernelId = kernel.id;
    this._chart = new UsageChart(trans.__('usage unknown'));
    const head = h('div', 'jp-GpuQuota-kernelHead');
    head.append(this._path, this._spec);
    // Two groups that wrap as wholes: the cap's field and buttons, then what acts on the kernel itself.
    const form = h('form', 'jp-GpuQuota-controls');
    const kernelGroup = h('div', 'jp-GpuQuota-kernelGroup');
    this._capInput.type = 'text';
    this._capInput.placeholder = trans.__('30%');
    this._capInput.title = trans.__(
      'A fraction of the GPU (0.3), a percentage (30%) or a size (12GiB), within what the admin allows'
    );
    this._capInput.setAttribute('aria-label', trans.__('New cap'));
    this._setButton.type = 'submit';
    this._setButton.textContent = trans.__('Set cap');
    this._resetButton.type = 'button';
    this._resetButton.textContent = trans.__('Reset');
    this._resetButton.title = trans.__('Back to the cap policy gives this kernel');
    this._shutdownButton.type = 'button';
    this._shutdownButton.textContent = trans.__('Shut down');
    this._shutdownButton.title = trans.__('Shut this kernel down');
    this._parkButton.type = 'button';
    this._parkButton.textContent = trans.__('Park');
    this._resumeButton.type = 'button';
    this._resumeButton.textContent = trans.__('Resume');
    this._capGroup.append(this._capInput, this._setButton, this._resetButton);
    kernelGroup.append(this._parkButton, this._resumeButton, this._shutdownButton);
    form.append(this._capGroup, kernelGroup);
    form.addEventListener('submit', event => {
      event.preventDefault();
      const cap = this._capInput.value.trim();
      if (cap) {
        void this._request({ cap });
      }
    });
    this._resetButton.addEventListener('click', () => void this._request({ reset: true }));
    this._shutdownButton.addEventListener('click', () => void this._shutdown());
    this._parkButton.addEventListener('click', () => void this._parkOrResume('park'));
    this._resumeButton.addEventListener('click', () => void this._parkOrResume('resume'));
    this._path.addEventListener('click', event => {
      event.preventDefault();
      if (this._kernel?.path) {
        this._actions.open(this._kernel.path);
      }
    });
    setHidden(this._feedback, true);
    setHidden(this._layers, true);
    setHidden(this._line, true);
    setHidden(this._chart.node, true);
    setHidden(this._parkButton, true);
    setHidden(this._resumeButton, true);
    this.node.append(
      head,
      this._devices,
      this._chart.node,
      this._layers,
      this._line,
      this._action,
      form,
      this._feedback
    );
  }

  update(kernel: IKernelStatus, current: boolean, view: IRowView): void {
    const trans = this._trans;
    this._kernel = kernel;
    if (this.node.classList.contains('jp-mod-current') !== current) {
      this.node.classList.toggle('jp-mod-current', current);
      setAttr(this.node, 'aria-current', String(current));
    }
    // The notebook's name; its folder and the kernel id in the tooltip.
    const name = kernel.path
      ? kernel.path.split('/').pop() || kernel.path
      : trans.__('kernel %1', kernel.id.slice(0, 8));
    setText(this._path, name);
    setAttr(
      this._path,
      'title',
      kernel.path ? trans.__('Open %1\nKernel %2', kernel.path, kernel.id) : kernel.id
    );
    setAttr(this._path, 'href', kernel.path ? '#' : '');
    setText(this._spec, kernel.kernelspec || '');

    const key = kernel.devices.map(d => d.index).join(',');
    if (key !== this._deviceKey) {
      this._deviceKey = key;
      this._deviceRows = kernel.devices.map(() => new KernelDeviceRow(trans));
      this._devices.replaceChildren(...this._deviceRows.map(r => r.node));
    }
    kernel.devices.forEach((device, i) => this._deviceRows[i].update(device, view.threshold, view.unknownWhy));

    // A chart costs a path of 300 points: drawn for rows in or near view (200 kernels, 20 on screen).
    if (this.inView) {
      this._updateChart(kernel, view.history);
      this.chartStale = false;
    } else {
      this.chartStale = true;
    }

    // Hard limit (MPS) or why there is none; nothing while the server's hard limits are off.
    const layers = layersLine(kernel.layers, trans, kernel.reasons?.hard_limit);
    setHidden(this._layers, !layers);
    if (layers) {
      setText(this._layers, layers.text);
      setAttr(this._layers, 'title', layers.title);
      this._layers.classList.toggle('jp-mod-hard', layers.hard);
    }

    setHidden(this._capGroup, !offersCap(kernel));
    this._updatePark(kernel);

    const action = kernel.last_action;
    setHidden(this._action, !action);
    if (action) {
      const parts = [trans.__('Watchdog: %1', action.action)];
      if (typeof action.used === 'number' && typeof action.cap === 'number') {
        parts.push(trans.__('at %1', formatPair(action.used, action.cap)));
      }
      if (typeof action.device === 'number') {
        parts.push(trans.__('on GPU %1', action.device));
      }
      if (action.attributed === 'environment') {
        parts.push(trans.__('(by processes outside the kernel that name it; warnings only)'));
      }
      let text = parts.join(' ');
      const age = formatAge(action.time, view.now);
      if (age) {
        text += `, ${age}`;
      }
      setText(this._action, text);
    }
  }

  /** Which marks the row's chart draws now (the legend shows those some chart has). */
  marks: IChartMarks = NO_MARKS;
  /** Whether the row is in or near the panel's view (the panel's IntersectionObserver says). */
  inView = true;
  /** Whether its chart has not been drawn for the last state (it was out of view). */
  chartStale = false;

  /**
   * The chart of the kernel's usage, when the server keeps a history for it: over the server's whole
   * window (points_max samples), or over the kernel's life while that is shorter (a minute at least), so
   * that a new kernel's first points are not a sliver at the edge.
   */
  private _updateChart(kernel: IKernelStatus, history: IHistory): void {
    const points = history.kernels[kernel.id];
    const shown = !!points && points.length > 0 && history.last !== null && kernel.devices.length > 0;
    setHidden(this._chart.node, !shown);
    if (!shown) {
      this.marks = NO_MARKS;
      return;
    }
    const most = history.pointsMax * history.interval;
    const lived = history.last! - points[0].t + history.interval;
    const seconds = Math.min(most, Math.max(MIN_CHART_SECONDS, lived));
    const chart = chartOf(points, history.last!, seconds, history.interval);
    this._chart.update(chart);
    this.marks = {
      hardLimit: chart.hardLimit !== '',
      park: chart.parks.some(band => band.state === 'parked'),
      waiting: chart.parks.some(band => band.state === 'waiting'),
      lost: chart.parks.some(band => band.state === 'lost')
    };
  }

  /** The row's one line (kernelLine), and the Park / Resume buttons as parkButtons() decides. */
  private _updatePark(kernel: IKernelStatus): void {
    const trans = this._trans;
    const line: IKernelLine | null = kernelLine(kernel);
    setHidden(this._line, !line);
    if (line) {
      let text: string;
      if (line.kind === 'cpu-only') {
        text = line.words ? labelled(trans.__('CPU only'), line.words) : trans.__('CPU only: no GPU granted');
      } else if (line.kind === 'not-parkable') {
        text = notParkableText(line.words);
      } else {
        text = line.words;
      }
      setText(this._line, text);
      setAttr(this._line, 'title', line.detail || (text.length > 60 ? text : ''));
      setAttr(this._line, 'data-park-state', line.state);
      setAttr(this._line, 'data-kind', line.kind);
      setLevel(this._line, line.level);
    }
    if (this._feedbackPark !== null && kernel.park && kernel.park.state !== this._feedbackPark) {
      this._feedbackPark = null;
      setHidden(this._feedback, true); // the line says what happened since
    }
    const buttons = parkButtons(kernel.park || null);
    setButton(this._parkButton, buttons.park, this._parkBusy);
    setButton(this._resumeButton, buttons.resume, this._parkBusy);
  }

  private async _request(request: { cap: string } | { reset: true }): Promise<void> {
    const trans = this._trans;
    this._setButton.disabled = this._resetButton.disabled = true;
    try {
      const result = await this._actions.setCap(this.id, request);
      const labels: Record<string, string> = {
        granted: trans.__('Granted'),
        clamped: trans.__('Clamped'),
        refused: trans.__('Refused'),
        invalid: trans.__('Not a cap')
      };
      this._showFeedback(
        labelled(labels[result.outcome] || result.outcome, result.message),
        result.outcome === 'granted' ? 'ok' : result.outcome === 'clamped' ? 'warning' : 'over'
      );
      if (result.outcome === 'granted' || result.outcome === 'clamped') {
        this._capInput.value = '';
      }
    } catch (error) {
      this._showFeedback(labelled(trans.__('Failed'), String((error as Error)?.message || error)), 'over');
    } finally {
      this._setButton.disabled = this._resetButton.disabled = false;
    }
  }

  private async _parkOrResume(action: 'park' | 'resume'): Promise<void> {
    this._parkBusy = true;
    this._parkButton.disabled = this._resumeButton.disabled = true;
    try {
      const result = await this._actions.park(this.id, action);
      const feedback = parkFeedback(action, result.outcome, result.message, result.park);
      this._showFeedback(feedback.text, feedback.level);
      if (result.park && this._kernel) {
        this._kernel = { ...this._kernel, park: result.park };
      }
      // An accepted request's words ("Parks when its current cell ends") last until the state moves on.
      this._feedbackPark = result.outcome === 'accepted' && result.park ? result.park.state : null;
    } catch (error) {
      const failed = action === 'park' ? this._trans.__('Park failed') : this._trans.__('Resume failed');
      this._showFeedback(labelled(failed, String((error as Error)?.message || error)), 'over');
    } finally {
      this._parkBusy = false;
      if (this._kernel) {
        this._updatePark(this._kernel);
      }
    }
  }

  private async _shutdown(): Promise<void> {
    if (!this._kernel) {
      return;
    }
    this._shutdownButton.disabled = true;
    try {
      await this._actions.shutdown(this._kernel);
    } catch (error) {
      this._showFeedback(
        labelled(this._trans.__('Shut down failed'), String((error as Error)?.message || error)),
        'over'
      );
    } finally {
      this._shutdownButton.disabled = false;
    }
  }

  private _showFeedback(text: string, level: string): void {
    this._feedbackPark = null;
    setText(this._feedback, text);
    setLevel(this._feedback, level);
    setHidden(this._feedback, false);
  }
}

/** What every row of one render shares. */
interface IRowView {
  threshold: number;
  /** Epoch ms: the ages of watchdog actions. */
  now: number;
  /** Why usage is unknown now, in the monitor's words: the tooltip of an unknown figure. */
  unknownWhy: string;
  history: IHistory;
}

/** Which of the marks that not every chart has a row's chart draws now. */
interface IChartMarks {
  hardLimit: boolean;
  park: boolean;
  waiting: boolean;
  lost: boolean;
}

const NO_MARKS: IChartMarks = { hardLimit: false, park: false, waiting: false, lost: false };

/** The key to the charts, once above the kernels: what each mark is (the hard limit and the park marks
 * only while some chart has them). */
class ChartLegend {
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
    // One line: what is wrong with the poll first, else what the server says of its GPU monitor
    // (a stalled monitor means every usage figure below is unknown). The raw words on hover.
    const notice = monitorNotice(status);
    const problem = this._messageFor(state);
    const message = problem ? problem.text : notice ? monitorNoticeText(trans, notice) : '';
    setHidden(this._message, !message);
    setText(this._message, message);
    const detail = problem ? problem.detail : notice ? notice.detail : '';
    setAttr(this._message, 'title', detail && !message.includes(detail) ? detail : '');
    setLevel(
      this._message,
      state.phase === 'error' || state.phase === 'missing' ? 'over' : notice && !problem ? notice.level : 'ok'
    );
    setAttr(this._message, 'data-monitor', notice && !problem ? notice.problem : '');
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

  /** What is wrong with the poll or the server, in words, and its raw detail; null when nothing is. */
  private _messageFor(state: IState): { text: string; detail: string } | null {
    const trans = this._trans;
    switch (state.phase) {
      case 'loading':
        return { text: trans.__('Loading GPU quotas…'), detail: '' };
      case 'missing':
        return { text: trans.__('The gpu-quota-ext server extension is not enabled on this server.'), detail: '' };
      case 'no-gpu': {
        const said = reasonText(state.status?.reasons?.no_gpu, state.status?.message);
        return said
          ? { text: labelled(trans.__('No GPU on this server'), said.words), detail: said.detail }
          : { text: trans.__('No GPU on this server.'), detail: '' };
      }
      case 'error':
        return { text: labelled(trans.__('Cannot read GPU quotas, retrying'), state.error), detail: '' };
      default:
        return null;
    }
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
