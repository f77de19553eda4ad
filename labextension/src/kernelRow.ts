/**
 * One kernel in the sidebar: its notebook (a link that opens it), its usage on each of its GPUs, a chart
 * of that usage over the last minutes, its hard limit, one line about itself (its park state, or the one
 * reason it cannot park or has no GPU, the raw detail on hover), the watchdog's last action, then its
 * controls (kernelControls.ts). The panel keeps one row per kernel id across polls and calls update() with
 * each new state; the row writes only what changed.
 */

import { TranslationBundle } from '@jupyterlab/translation';

import { chartOf } from './chart';
import { IChartMarks, NO_MARKS } from './chartLegend';
import { UsageChart } from './chartView';
import { IKernelPark, IKernelStatus, ILastAction } from './contract';
import { IKernelLine, kernelLine } from './derive';
import { h, setAttr, setHidden, setLevel, setText } from './dom';
import { formatAge, formatPair, labelled, notParkableText } from './format';
import { KernelControls } from './kernelControls';
import { KernelDeviceRow } from './kernelDeviceRow';
import { layersLine } from './layers';
import { IPanelActions } from './panelActions';
import { IHistory } from './state';

/** The shortest window a chart shows (seconds). */
const MIN_CHART_SECONDS = 60;

/** What every row of one render shares. */
export interface IRowView {
  threshold: number;
  /** Epoch ms: the ages of watchdog actions. */
  now: number;
  /** Why usage is unknown now, in the monitor's words: the tooltip of an unknown figure. */
  unknownWhy: string;
  history: IHistory;
}

/** The row's one line in words: kernelLine() decides what it is about, this says it. */
function kernelLineText(trans: TranslationBundle, line: IKernelLine): string {
  if (line.kind === 'cpu-only') {
    return line.words ? labelled(trans.__('CPU only'), line.words) : trans.__('CPU only: no GPU granted');
  }
  if (line.kind === 'not-parkable') {
    return notParkableText(line.words);
  }
  return line.words;
}

/** The watchdog's last action on the kernel: what, at which usage against which cap, on which GPU, when. */
function watchdogText(trans: TranslationBundle, action: ILastAction, now: number): string {
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
  const age = formatAge(action.time, now);
  if (age) {
    text += `, ${age}`;
  }
  return text;
}

export class KernelRow {
  readonly node = h('li', 'jp-GpuQuota-kernel');
  readonly id: string;
  /** Which marks the row's chart draws now (the legend shows those some chart has). */
  marks: IChartMarks = NO_MARKS;
  /** Whether the row is in or near the panel's view (the panel's IntersectionObserver says). */
  inView = true;
  /** Whether its chart has not been drawn for the last state (it was out of view). */
  chartStale = false;

  private _path = h('a', 'jp-GpuQuota-path');
  private _spec = h('span', 'jp-GpuQuota-spec');
  private _devices = h('div', 'jp-GpuQuota-kernelDevices');
  private _deviceRows: KernelDeviceRow[] = [];
  private _deviceKey = '';
  private _chart: UsageChart;
  private _layers = h('div', 'jp-GpuQuota-layers');
  private _line = h('div', 'jp-GpuQuota-line');
  private _action = h('div', 'jp-GpuQuota-action');
  private _controls: KernelControls;
  private _kernel: IKernelStatus | null = null;

  constructor(
    kernel: IKernelStatus,
    private _trans: TranslationBundle,
    private _actions: IPanelActions
  ) {
    this.id = kernel.id;
    this.node.dataset.kernelId = kernel.id;
    this._chart = new UsageChart(_trans.__('usage unknown'));
    this._controls = new KernelControls(
      kernel.id,
      _trans,
      _actions,
      () => this._kernel,
      park => this._parkSettled(park)
    );
    const head = h('div', 'jp-GpuQuota-kernelHead');
    head.append(this._path, this._spec);
    this._path.addEventListener('click', event => {
      event.preventDefault();
      if (this._kernel?.path) {
        this._actions.open(this._kernel.path);
      }
    });
    setHidden(this._layers, true);
    setHidden(this._line, true);
    setHidden(this._chart.node, true);
    this.node.append(
      head,
      this._devices,
      this._chart.node,
      this._layers,
      this._line,
      this._action,
      this._controls.form,
      this._controls.feedback
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

    // The GPU rows are rebuilt only when the kernel's set of GPUs changes.
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

    this._controls.update(kernel);
    this._updatePark(kernel);

    const action = kernel.last_action;
    setHidden(this._action, !action);
    if (action) {
      setText(this._action, watchdogText(trans, action, view.now));
    }
  }

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
    const line: IKernelLine | null = kernelLine(kernel);
    setHidden(this._line, !line);
    if (line) {
      const text = kernelLineText(this._trans, line);
      setText(this._line, text);
      setAttr(this._line, 'title', line.detail || (text.length > 60 ? text : ''));
      setAttr(this._line, 'data-park-state', line.state);
      setAttr(this._line, 'data-kind', line.kind);
      setLevel(this._line, line.level);
    }
    this._controls.updatePark(kernel);
  }

  /** A Park / Resume request ended: the state the server answered is shown now, not at the next poll. */
  private _parkSettled(park: IKernelPark | null): void {
    if (park && this._kernel) {
      this._kernel = { ...this._kernel, park };
    }
    if (this._kernel) {
      this._updatePark(this._kernel);
    }
  }
}
