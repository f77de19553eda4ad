/**
 * The one poller the sidebar and the status bar share: a Lumino Poll on the status route (and, while the
 * sidebar shows, on the history route, incrementally with `since`), its answers reduced into an IState
 * (see state.ts), a signal when that state changes.
 */

import { ServerConnection } from '@jupyterlab/services';
import { IDisposable } from '@lumino/disposable';
import { IPoll, Poll } from '@lumino/polling';
import { ISignal, Signal } from '@lumino/signaling';

import { fetchHistory, fetchStatus, MissingExtensionError } from './api';
import { normalizeStatus } from './contract';
import { canReuseShared, ISharedStatus } from './share';
import { Action, INITIAL_STATE, IState, reduce } from './state';

export const DEFAULT_INTERVAL_MS = 2000;
export const DEFAULT_WARNING_THRESHOLD = 0.9;

export interface IQuotaModelOptions {
  serverSettings: ServerConnection.ISettings;
  interval?: number;
  /** True while someone looks at the data (the panel or the status bar item is visible). */
  isWatched?: () => boolean;
  /** True while the usage charts show (the panel is visible): each tick then asks for the history too. */
  wantsHistory?: () => boolean;
}

export class QuotaModel implements IDisposable {
  constructor(options: IQuotaModelOptions) {
    this._settings = options.serverSettings;
    this._isWatched = options.isWatched || (() => true);
    this._wantsHistory = options.wantsHistory || (() => false);
    this._interval = options.interval || DEFAULT_INTERVAL_MS;
    // Tabs of one browser on one server share what they fetch (BroadcastChannel, same origin only).
    if (typeof BroadcastChannel !== 'undefined') {
      this._channel = new BroadcastChannel(`gpu-quota-ext:${this._settings.baseUrl}`);
      this._channel.onmessage = (event: MessageEvent) => {
        const data = event.data;
        if (data && typeof data.time === 'number' && data.status) {
          this._shared = { time: data.time, status: normalizeStatus(data.status) };
        }
      };
    }
    this._poll = new Poll({
      auto: true,
      name: 'gpu-quota-ext:status',
      factory: () => this._tick(),
      frequency: QuotaModel.frequency(this._interval),
      // Standby while the document is hidden, or while neither the panel nor the status bar shows.
      standby: () =>
        (typeof document !== 'undefined' && document.hidden) || !this._isWatched()
    });
  }

  /** Backoff on errors (a 404 included), up to 15 intervals or 30 s, whichever is longer. */
  static frequency(interval: number): IPoll.Frequency {
    return { interval, backoff: true, max: Math.max(30000, interval * 15) };
  }

  get changed(): ISignal<this, IState> {
    return this._changed;
  }

  get state(): IState {
    return this._state;
  }

  get interval(): number {
    return this._interval;
  }

  set interval(value: number) {
    if (!(value > 0) || value === this._interval) {
      return;
    }
    this._interval = value;
    this._poll.frequency = QuotaModel.frequency(value);
  }

  get isDisposed(): boolean {
    return this._poll.isDisposed;
  }

  /** The kernel of the notebook the user works in; an answer asked for another one is dropped. */
  setCurrentKernel(kernelId: string | null): void {
    const before = this._state.currentKernelId;
    this.dispatch({ type: 'current', kernelId });
    if (before !== kernelId) {
      void this.refresh();
    }
  }

  /**
   * Ask now (the panel shown, another notebook current); `fresh` (after a cap change or a shutdown)
   * goes to the server even when another tab has just fetched.
   */
  refresh(fresh = false): Promise<void> {
    if (this._poll.isDisposed) {
      return Promise.resolve();
    }
    if (fresh) {
      this._fresh = true;
    }
    return this._poll.refresh();
  }

  dispatch(action: Action): void {
    const next = reduce(this._state, action);
    if (next !== this._state) {
      this._state = next;
      this._changed.emit(next);
    }
  }

  dispose(): void {
    this._channel?.close();
    this._poll.dispose();
    Signal.clearData(this);
  }

  private async _tick(): Promise<void> {
    const seq = ++this._requestSeq;
    const kernelId = this._state.currentKernelId;
    const fresh = this._fresh;
    this._fresh = false;
    // Asked beside the status, not after it: a tick takes one round trip.
    const history = this._askHistory();
    if (canReuseShared(this._shared, Date.now(), this._interval, fresh)) {
      this.dispatch({ type: 'status', seq, kernelId, status: this._shared!.status });
      await history;
      return;
    }
    try {
      const status = await fetchStatus(this._settings);
      this.dispatch({ type: 'status', seq, kernelId, status });
      if (this._channel) {
        this._channel.postMessage({ time: Date.now(), status });
      }
    } catch (error) {
      if (error instanceof MissingExtensionError) {
        this.dispatch({ type: 'missing', seq, kernelId });
      } else {
        this.dispatch({ type: 'error', seq, kernelId, message: String((error as Error)?.message || error) });
      }
      throw error; // the Poll backs off
    } finally {
      await history;
    }
  }

  /**
   * The history points newer than the last one held (all of them the first time, or after a while
   * unwatched), when the charts show and the server has the route. Never throws: a chart that cannot be
   * fed is no reason for the poll to back off.
   */
  private async _askHistory(): Promise<void> {
    if (!this._historyRoute || !this._wantsHistory()) {
      return;
    }
    const seq = ++this._historySeq;
    const since = this._state.history.last;
    try {
      const answer = await fetchHistory(this._settings, since);
      this.dispatch({ type: 'history', seq, full: since === null, answer });
    } catch (error) {
      if (error instanceof MissingExtensionError) {
        this._historyRoute = false; // an older server: the rows show no chart
      }
    }
  }

  private _settings: ServerConnection.ISettings;
  private _isWatched: () => boolean;
  private _wantsHistory: () => boolean;
  private _historyRoute = true;
  private _historySeq = 0;
  private _interval: number;
  private _poll: Poll;
  private _requestSeq = 0;
  private _channel: BroadcastChannel | null = null;
  private _shared: ISharedStatus | null = null;
  private _fresh = false;
  private _state: IState = INITIAL_STATE;
  private _changed = new Signal<this, IState>(this);
}
