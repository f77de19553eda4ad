/**
 * The sidebar's state and its reduction, as pure functions: which of the server's answers are applied
 * (an answer overtaken by a later one, or asked for a kernel no longer current, is dropped), and how the
 * usage history grows from incremental answers, bounded as the server bounds it. (Whether another tab's
 * answer may stand in for one: share.ts.) No JupyterLab imports.
 */

import { IHistoryAnswer, IHistoryPoint, IQuotaStatus } from './contract';

/**
 * loading: nothing heard yet; ok: a status with GPUs; no-gpu: the server says there is none;
 * missing: the status route answered 404 (the server extension is not installed or not enabled);
 * error: the last poll failed (the last good status is kept and shown).
 */
export type Phase = 'loading' | 'ok' | 'no-gpu' | 'missing' | 'error';

/** Each kernel's usage over the last minutes, as the history routes gave it (the server's clock). */
export interface IHistory {
  /** Seconds between points. */
  interval: number;
  /** The most points kept per kernel (the server's points_max). */
  pointsMax: number;
  kernels: Record<string, IHistoryPoint[]>;
  /** The newest point's time: the next request asks for points after it. Null: ask for all. */
  last: number | null;
  /** Sequence number of the last history answer applied. */
  seq: number;
}

export const EMPTY_HISTORY: IHistory = { interval: 1, pointsMax: 300, kernels: {}, last: null, seq: 0 };

export interface IState {
  phase: Phase;
  status: IQuotaStatus | null;
  /** Why the last poll failed, when phase is "error". */
  error: string | null;
  /** The kernel of the current notebook (or console), if any. */
  currentKernelId: string | null;
  /** Sequence number of the last request whose answer was applied. */
  seq: number;
  history: IHistory;
}

export const INITIAL_STATE: IState = {
  phase: 'loading',
  status: null,
  error: null,
  currentKernelId: null,
  seq: 0,
  history: EMPTY_HISTORY
};

/**
 * Every status answer carries the request's sequence number and the kernel that was current when it
 * was sent, so that an answer overtaken by a later one, or asked for a kernel no longer current, is
 * dropped (the model asks again at once when the current kernel changes). A history answer carries
 * its own sequence number and whether it was asked without `since` (all kept points).
 */
export type Action =
  | { type: 'current'; kernelId: string | null }
  | { type: 'status'; seq: number; kernelId: string | null; status: IQuotaStatus }
  | { type: 'missing'; seq: number; kernelId: string | null }
  | { type: 'error'; seq: number; kernelId: string | null; message: string }
  | { type: 'removed'; kernelId: string }
  | { type: 'history'; seq: number; full: boolean; answer: IHistoryAnswer };

export function isStale(state: IState, seq: number, kernelId: string | null): boolean {
  return seq <= state.seq || kernelId !== state.currentKernelId;
}

/**
 * The history with an answer merged in: each kernel's new points after its last one, at most
 * `points_max` kept (the oldest dropped); kernels the server no longer lists are dropped (it lists every
 * kernel it keeps, with no points when none is newer). A full answer replaces what was there.
 */
export function mergeHistory(history: IHistory, answer: IHistoryAnswer, seq: number, full: boolean): IHistory {
  if (seq <= history.seq) {
    return history;
  }
  const pointsMax = answer.points_max;
  const kernels: Record<string, IHistoryPoint[]> = {};
  let last = full ? null : history.last;
  for (const [id, points] of Object.entries(answer.kernels)) {
    const kept = full ? [] : history.kernels[id] || [];
    const after = kept.length ? kept[kept.length - 1].t : -Infinity;
    const fresh = points.filter(p => p.t > after);
    let merged = fresh.length ? kept.concat(fresh) : kept;
    if (merged.length > pointsMax) {
      merged = merged.slice(merged.length - pointsMax);
    }
    kernels[id] = merged;
    if (merged.length) {
      const newest = merged[merged.length - 1].t;
      last = last === null ? newest : Math.max(last, newest);
    }
  }
  return { interval: answer.interval, pointsMax, kernels, last, seq };
}

export function reduce(state: IState, action: Action): IState {
  switch (action.type) {
    case 'current':
      if (action.kernelId === state.currentKernelId) {
        return state;
      }
      return { ...state, currentKernelId: action.kernelId };
    case 'status':
      if (isStale(state, action.seq, action.kernelId)) {
        return state;
      }
      return {
        ...state,
        seq: action.seq,
        phase: action.status.gpu ? 'ok' : 'no-gpu',
        status: action.status,
        error: null
      };
    case 'missing':
      if (isStale(state, action.seq, action.kernelId)) {
        return state;
      }
      return { ...state, seq: action.seq, phase: 'missing', status: null, error: null };
    case 'error':
      if (isStale(state, action.seq, action.kernelId)) {
        return state;
      }
      return { ...state, seq: action.seq, phase: 'error', error: action.message };
    case 'removed': {
      // A kernel shut down from the panel disappears at once, before the next poll confirms it.
      if (!state.status) {
        return state;
      }
      const kernels = state.status.kernels.filter(k => k.id !== action.kernelId);
      if (kernels.length === state.status.kernels.length) {
        return state;
      }
      return { ...state, status: { ...state.status, kernels } };
    }
    case 'history': {
      const history = mergeHistory(state.history, action.answer, action.seq, action.full);
      return history === state.history ? state : { ...state, history };
    }
  }
  return state;
}
