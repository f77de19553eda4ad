/**
 * The panel's state and everything derived from it, as pure functions: what the server said
 * (normalized so that optional fields may be missing), which replies to keep, how kernels are
 * ordered, which usage figure a bar shows and when it turns to a warning. No JupyterLab imports.
 */

import { formatBytes, formatPair, toMillis } from './format';
import { IKernelLayers } from './layers';

// --- the server's contract: GET /api/gpu-quota/status (fields marked ? may be missing) ----------

export interface IDeviceStatus {
  index: number;
  name: string;
  uuid?: string;
  total: number;
  budget?: number | null;
  granted: number;
  kernels: number;
  /** NVML: memory used on the device by every process. */
  used?: number | null;
}

export interface IKernelDevice {
  index: number;
  cap: number;
  max_cap?: number;
  policy_cap?: number;
  /** NVML: the kernel's whole process tree on this device. */
  used?: number | null;
  /** torch allocator, reported by the kernel itself. */
  allocated?: number | null;
  reserved?: number | null;
  peak?: number | null;
  /** When the kernel last reported its allocator, seconds since the epoch. */
  reported_at?: number | null;
}

export interface ILastAction {
  time: number | string;
  action: string;
  device?: number | null;
  used?: number | null;
  cap?: number | null;
  /** "tree" (the kernel's own processes) or "environment" (processes outside it naming it: warn only). */
  attributed?: string;
}

export interface IKernelStatus {
  id: string;
  user?: string;
  kernelspec?: string;
  path?: string | null;
  source?: string;
  placed?: boolean;
  cpu_only_reason?: string | null;
  devices: IKernelDevice[];
  last_action?: ILastAction | null;
  layers?: IKernelLayers | null;
  /** Parking: where the kernel's GPU memory is (absent from a server that does not park). */
  park?: IKernelPark | null;
}

// --- parking: each kernel's "park" object, and the park / resume routes (shared/contract.py) ------

/** POST kernels/<id>/park: park once the current cell has finished; /resume: bring it back now. */
export const PARK_SUFFIX = 'park';
export const RESUME_SUFFIX = 'resume';

/** A kernel's park state, as the contract lists them (PARK_STATES). */
export const PARK_STATES = [
  'busy',
  'idle',
  'pending',
  'parking',
  'parked',
  'resuming',
  'waiting'
] as const;
export type ParkState = (typeof PARK_STATES)[number];

export interface IKernelPark {
  state: ParkState;
  /** When the state began, wall clock in seconds. */
  since?: number | null;
  /** Seconds since jupyter_server last saw the kernel active. */
  idle_seconds?: number | null;
  /** Bytes the driver holds on the host for it while parked. */
  host_bytes?: number | null;
  /** False: parking cannot work for it (the reason says why). */
  parkable: boolean;
  /** Why not parkable, why it did not park, or what a waiting resume waits for. */
  reason?: string | null;
}

/** The server's GPU monitor: how fresh its usage figures are. */
export interface IMonitorStatus {
  /** "starting", "ok", "degraded", "error", "no-gpu", "off", or "stalled" (a sample has not come back). */
  state: string;
  message?: string | null;
  /** When the last sample was taken, seconds since the epoch. */
  sampled_at?: number | null;
  poll_interval?: number;
  /** How long a sample may be out before the state is "stalled", in seconds. */
  stalled_after?: number;
}

export interface IQuotaStatus {
  gpu: boolean;
  message?: string | null;
  user?: string;
  devices: IDeviceStatus[];
  kernels: IKernelStatus[];
  policy?: Record<string, unknown>;
  monitor?: IMonitorStatus | null;
  /** The watchdog's recent actions, oldest first. */
  actions?: ILastAction[];
  /** The hard limit (MPS) as the server runs it; the sidebar does not show it. */
  hard_cap?: Record<string, unknown> | null;
}

const isNumber = (value: unknown): value is number =>
  typeof value === 'number' && Number.isFinite(value);

/** The reply as the view may rely on it: lists always present, numbers numbers. */
export function normalizeStatus(raw: any): IQuotaStatus {
  const data = raw && typeof raw === 'object' ? raw : {};
  const devices: IDeviceStatus[] = Array.isArray(data.devices)
    ? data.devices
        .filter((d: any) => d && isNumber(d.index))
        .map((d: any) => ({
          ...d,
          name: typeof d.name === 'string' ? d.name : `GPU ${d.index}`,
          total: isNumber(d.total) ? d.total : 0,
          granted: isNumber(d.granted) ? d.granted : 0,
          kernels: isNumber(d.kernels) ? d.kernels : 0
        }))
    : [];
  const kernels: IKernelStatus[] = Array.isArray(data.kernels)
    ? data.kernels
        .filter((k: any) => k && typeof k.id === 'string')
        .map((k: any) => ({
          ...k,
          devices: Array.isArray(k.devices)
            ? k.devices.filter((d: any) => d && isNumber(d.index) && isNumber(d.cap))
            : [],
          park:
            k.park && typeof k.park === 'object' && typeof k.park.state === 'string'
              ? { ...k.park, parkable: k.park.parkable !== false }
              : null
        }))
    : [];
  const monitor: IMonitorStatus | null =
    data.monitor && typeof data.monitor === 'object' && typeof data.monitor.state === 'string'
      ? {
          ...data.monitor,
          message: typeof data.monitor.message === 'string' ? data.monitor.message : null
        }
      : null;
  return {
    ...data,
    gpu: data.gpu === true,
    message: typeof data.message === 'string' ? data.message : null,
    devices,
    kernels,
    monitor
  };
}

// --- what the server says in words ------------------------------------------------------------

/** The most of a server's message the sidebar shows; the rest is cut with an ellipsis. */
export const MAX_MESSAGE_CHARS = 300;

/** `text` cut to `max` characters, the last one an ellipsis when anything was cut. */
export function shorten(text: string, max = MAX_MESSAGE_CHARS): string {
  return text.length > max ? `${text.slice(0, max - 1)}…` : text;
}

/**
 * The message of an error answer (`{"message": ..., "reason": ...}`), as written: shown as text,
 * never used as a format (a "25%" stays "25%"), and cut when it is long; `fallback` (the HTTP status
 * text) when the answer has none.
 */
export function serverMessage(body: unknown, fallback: string): string {
  const data = body && typeof body === 'object' ? (body as Record<string, unknown>) : {};
  for (const key of ['message', 'reason']) {
    const value = data[key];
    if (typeof value === 'string' && value.trim()) {
      return shorten(value.trim());
    }
  }
  return fallback;
}

/**
 * A (translated) label followed by words from the server: joined, never passed through the
 * translator as a format argument, whose "%%" handling would change a message that contains one.
 */
export function labelled(label: string, message: string | null | undefined): string {
  if (!message) {
    return label;
  }
  const wanted = label.toLowerCase();
  let said = message;
  // The server's message may open with a shorter form of the label ("no GPU: ..." under "No GPU on
  // this server"): say it once.
  const colon = said.indexOf(':');
  if (colon > 0 && wanted.startsWith(said.slice(0, colon).trim().toLowerCase())) {
    said = said.slice(colon + 1).trim();
  }
  // ... or already say what the label says ("clamped to ..." under "Clamped"): then it stands alone.
  if (said.toLowerCase().includes(wanted)) {
    return said.charAt(0).toUpperCase() + said.slice(1);
  }
  return said ? `${label}: ${said}` : label;
}

export type MonitorProblem = 'stalled' | 'error' | 'degraded';

export interface IMonitorNotice {
  problem: MonitorProblem;
  /** The server's words about it (may be empty). */
  message: string;
  level: Level;
}

/**
 * What the sidebar must say about the monitor, or null when its figures can be trusted. "stalled":
 * no sample for a while (usage shown is unknown, the watchdog cannot act); "error": no GPU could be
 * read; "degraded": some could not.
 */
export function monitorNotice(status: IQuotaStatus | null): IMonitorNotice | null {
  const monitor = status?.monitor;
  if (!status || !status.gpu || !monitor) {
    return null;
  }
  const message = shorten(monitor.message || '');
  switch (monitor.state) {
    case 'stalled':
      return { problem: 'stalled', message, level: 'over' };
    case 'error':
      return { problem: 'error', message, level: 'over' };
    case 'degraded':
      return { problem: 'degraded', message, level: 'warning' };
    default:
      return null;
  }
}

// --- which usage figure a bar shows ------------------------------------------------------------

/** Where a usage figure came from: NVML (whole process), the torch allocator, or nothing yet. */
export type UsageSource = 'nvml' | 'allocator' | 'none';

export interface IUsage {
  bytes: number;
  source: UsageSource;
}

/** Prefer NVML's "used" (everything the process holds), else the allocator's "reserved", else 0. */
export function kernelDeviceUsage(device: IKernelDevice): IUsage {
  if (isNumber(device.used)) {
    return { bytes: device.used, source: 'nvml' };
  }
  if (isNumber(device.reserved)) {
    return { bytes: device.reserved, source: 'allocator' };
  }
  return { bytes: 0, source: 'none' };
}

export type Level = 'ok' | 'warning' | 'over';

/** "warning" from `threshold` of the cap (0.9 by default), "over" at or past the cap. */
export function usageLevel(used: number, cap: number, threshold = 0.9): Level {
  if (!(cap > 0)) {
    return used > 0 ? 'over' : 'ok';
  }
  const fraction = used / cap;
  if (fraction > 1) {
    return 'over';
  }
  return fraction >= threshold ? 'warning' : 'ok';
}

/** Fraction of the bar to fill, 0..1. */
export function barFraction(used: number, whole: number): number {
  if (!(whole > 0)) {
    return 0;
  }
  return Math.min(1, Math.max(0, used / whole));
}

// --- ordering --------------------------------------------------------------------------------

/** The current kernel first; then kernels with a notebook path, by path; then the rest, by id. */
export function sortKernels(
  kernels: readonly IKernelStatus[],
  currentId: string | null
): IKernelStatus[] {
  return [...kernels].sort((a, b) => {
    if (a.id === currentId) {
      return b.id === currentId ? 0 : -1;
    }
    if (b.id === currentId) {
      return 1;
    }
    const pa = a.path || '';
    const pb = b.path || '';
    if (pa && !pb) {
      return -1;
    }
    if (pb && !pa) {
      return 1;
    }
    if (pa !== pb) {
      return pa < pb ? -1 : 1;
    }
    return a.id < b.id ? -1 : a.id > b.id ? 1 : 0;
  });
}

// --- state and its reduction ------------------------------------------------------------------

/**
 * loading: nothing heard yet; ok: a status with GPUs; no-gpu: the server says there is none;
 * missing: the status route answered 404 (the server extension is not installed or not enabled);
 * error: the last poll failed (the last good status is kept and shown).
 */
export type Phase = 'loading' | 'ok' | 'no-gpu' | 'missing' | 'error';

export interface IState {
  phase: Phase;
  status: IQuotaStatus | null;
  /** Why the last poll failed, when phase is "error". */
  error: string | null;
  /** The kernel of the current notebook (or console), if any. */
  currentKernelId: string | null;
  /** Sequence number of the last request whose answer was applied. */
  seq: number;
}

export const INITIAL_STATE: IState = {
  phase: 'loading',
  status: null,
  error: null,
  currentKernelId: null,
  seq: 0
};

/**
 * Every answer carries the request's sequence number and the kernel that was current when it was
 * sent, so that an answer overtaken by a later one, or asked for a kernel no longer current, is
 * dropped (the model asks again at once when the current kernel changes).
 */
export type Action =
  | { type: 'current'; kernelId: string | null }
  | { type: 'status'; seq: number; kernelId: string | null; status: IQuotaStatus }
  | { type: 'missing'; seq: number; kernelId: string | null }
  | { type: 'error'; seq: number; kernelId: string | null; message: string }
  | { type: 'removed'; kernelId: string };

export function isStale(state: IState, seq: number, kernelId: string | null): boolean {
  return seq <= state.seq || kernelId !== state.currentKernelId;
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
  }
  return state;
}

// --- sharing one poll between the tabs of a browser ---------------------------------------------

/** A status another tab of this browser fetched from the same server, at `time` (epoch ms). */
export interface ISharedStatus {
  time: number;
  status: IQuotaStatus;
}

/**
 * Whether a tick may use what another tab fetched instead of asking the server: when it is younger
 * than half an interval (so ten open tabs cost the server one or two requests per interval, not ten,
 * and a figure is at most 1.5 intervals old), and this tick was not asked for fresh data (a cap
 * change or a shutdown from this tab).
 */
export function canReuseShared(
  shared: ISharedStatus | null,
  now: number,
  interval: number,
  force: boolean
): boolean {
  if (force || !shared) {
    return false;
  }
  const age = now - shared.time;
  return age >= 0 && age < interval / 2;
}

// --- the status bar ---------------------------------------------------------------------------

export interface IStatusBarInfo {
  /** "GPU 3.2 / 10 GiB", or "GPU: CPU only" for a kernel given no GPU. */
  text: string;
  level: Level;
  kernel: IKernelStatus;
  /** The device shown: the one nearest its cap. Null for a CPU-only kernel. */
  device: IKernelDevice | null;
  usage: IUsage | null;
}

/** What the status bar shows for the current kernel, or null (item hidden) when it has no grant. */
export function statusBarInfo(state: IState, threshold = 0.9): IStatusBarInfo | null {
  const kernelId = state.currentKernelId;
  if (!kernelId || !state.status || state.phase === 'missing') {
    return null;
  }
  const kernel = state.status.kernels.find(k => k.id === kernelId);
  if (!kernel) {
    return null;
  }
  if (kernel.devices.length === 0) {
    return { text: 'GPU: CPU only', level: 'ok', kernel, device: null, usage: null };
  }
  let best = kernel.devices[0];
  let bestUsage = kernelDeviceUsage(best);
  for (const device of kernel.devices.slice(1)) {
    const usage = kernelDeviceUsage(device);
    if (barFraction(usage.bytes, device.cap) > barFraction(bestUsage.bytes, best.cap)) {
      best = device;
      bestUsage = usage;
    }
  }
  return {
    text: `GPU ${formatPair(bestUsage.bytes, best.cap)}`,
    level: usageLevel(bestUsage.bytes, best.cap, threshold),
    kernel,
    device: best,
    usage: bestUsage
  };
}

// --- parking in words, and which of the Park / Resume buttons a kernel row offers ----------------

/** "40 s", "12 min", "2 h 5 min". */
export function formatDuration(seconds: number): string {
  const s = Math.max(0, Math.floor(seconds));
  if (s < 60) {
    return `${s} s`;
  }
  if (s < 3600) {
    return `${Math.floor(s / 60)} min`;
  }
  const hours = Math.floor(s / 3600);
  const minutes = Math.floor((s % 3600) / 60);
  return minutes ? `${hours} h ${minutes} min` : `${hours} h`;
}

/** "14:02" in the browser's time zone; "" when the time cannot be read. */
export function formatClock(time: number | null | undefined): string {
  const millis = toMillis(time);
  if (millis === null) {
    return '';
  }
  const date = new Date(millis);
  const pad = (n: number) => String(n).padStart(2, '0');
  return `${pad(date.getHours())}:${pad(date.getMinutes())}`;
}

/**
 * A kernel's park state as the sidebar says it ("running", "idle for 12 min", "parked since 14:02,
 * 17.8 GiB on host", "resuming", "waiting for device memory: <reason>"); the same words as %gpucap
 * (gpu_quota_ext/kernel/park.py).
 */
export function parkWords(park: IKernelPark): string {
  const reason = typeof park.reason === 'string' && park.reason ? shorten(park.reason) : '';
  switch (park.state) {
    case 'busy':
      return 'running';
    case 'idle':
      return isNumber(park.idle_seconds) ? `idle for ${formatDuration(park.idle_seconds)}` : 'idle';
    case 'pending':
      return 'parks when its current cell ends';
    case 'parking':
      return 'parking: its GPU memory is moving to host memory';
    case 'parked': {
      let words = 'parked';
      const since = formatClock(park.since);
      if (since) {
        words += ` since ${since}`;
      }
      if (isNumber(park.host_bytes)) {
        words += `, ${formatBytes(park.host_bytes)} on host`;
      }
      return words;
    }
    case 'resuming':
      return 'resuming';
    case 'waiting':
      return reason ? `waiting for device memory: ${reason}` : 'waiting for device memory';
    default:
      return String(park.state || 'unknown');
  }
}

export interface IParkButton {
  visible: boolean;
  enabled: boolean;
  /** The tooltip: what the button does, or why it cannot be used now. */
  title: string;
}

export interface IParkButtons {
  park: IParkButton;
  resume: IParkButton;
}

const HIDDEN: IParkButton = { visible: false, enabled: false, title: '' };
export const PARK_TITLE =
  'Move this kernel\'s GPU memory to host memory once its current cell has finished; its next cell brings it back';
export const RESUME_TITLE = 'Bring this kernel\'s GPU memory back now (its next cell would too)';

/**
 * Park when parkable and not parked; Resume when parked or waiting; a kernel that cannot be parked
 * shows Park disabled with the server's reason as its tooltip. No park object (a server that does
 * not park): neither button.
 */
export function parkButtons(park: IKernelPark | null | undefined): IParkButtons {
  if (!park) {
    return { park: HIDDEN, resume: HIDDEN };
  }
  if (park.parkable === false) {
    const why = typeof park.reason === 'string' && park.reason ? shorten(park.reason) : 'not parkable';
    return { park: { visible: true, enabled: false, title: why }, resume: HIDDEN };
  }
  switch (park.state) {
    case 'busy':
    case 'idle':
      return { park: { visible: true, enabled: true, title: PARK_TITLE }, resume: HIDDEN };
    case 'pending':
    case 'parking':
      return { park: { visible: true, enabled: false, title: parkWords(park) }, resume: HIDDEN };
    case 'parked':
    case 'waiting':
      return { park: HIDDEN, resume: { visible: true, enabled: true, title: RESUME_TITLE } };
    case 'resuming':
      return { park: HIDDEN, resume: { visible: true, enabled: false, title: 'resuming' } };
    default:
      return { park: HIDDEN, resume: HIDDEN };
  }
}

// Openings that already say the server refused: said once ("not parkable: MPS client", never
// "Cannot park: not parkable: MPS client"). The same list as gpu_quota_ext/kernel/park.py.
const REFUSAL_OPENINGS = ['cannot park', 'cannot resume', 'not parkable', 'not parked', 'did not park', 'not resumed'];

/** The server's refusal of a park or resume, as written and said once, capitalised. */
export function refusalText(message: string | null | undefined, action: 'park' | 'resume'): string {
  const said = (message || '').trim().replace(/\s+/g, ' ');
  const capital = (text: string) => text.charAt(0).toUpperCase() + text.slice(1);
  if (REFUSAL_OPENINGS.some(opening => said.toLowerCase().startsWith(opening))) {
    return capital(shorten(said));
  }
  return said ? `Cannot ${action}: ${shorten(said)}` : `Cannot ${action}`;
}

/** Why a kernel cannot be parked, "Not parkable" said once whether or not the server's reason says it. */
export function notParkableText(reason: string | null | undefined): string {
  const said = (reason || '').trim().replace(/\s+/g, ' ');
  if (!said) {
    return 'Not parkable';
  }
  if (REFUSAL_OPENINGS.some(opening => said.toLowerCase().startsWith(opening))) {
    return shorten(said.charAt(0).toUpperCase() + said.slice(1));
  }
  return `Not parkable: ${shorten(said)}`;
}

export interface IParkFeedback {
  text: string;
  level: Level;
}

/** What a row says after its Park or Resume button was answered. */
export function parkFeedback(
  action: 'park' | 'resume',
  outcome: 'accepted' | 'refused',
  message: string,
  park: IKernelPark | null
): IParkFeedback {
  if (outcome === 'refused') {
    return { text: refusalText(message, action), level: 'over' };
  }
  if (park && park.parkable === false) {
    return { text: refusalText(park.reason || 'not parkable', action), level: 'over' };
  }
  if (!park) {
    return { text: action === 'park' ? 'Park asked' : 'Resume asked', level: 'ok' };
  }
  const words = parkWords(park);
  return { text: words.charAt(0).toUpperCase() + words.slice(1), level: 'ok' };
}
