/**
 * What the sidebar and the status bar show, derived from the state as pure decisions: which usage figure a
 * bar shows (or that usage is unknown), when it turns to a warning, how kernels are ordered, what the
 * banner says about the monitor, the one line each kernel row says about itself, which of the Park /
 * Resume buttons it offers, and whether it offers a cap. No JupyterLab imports.
 */

import { IKernelDevice, IKernelPark, IKernelStatus, IQuotaStatus, isNumber, ParkState } from './contract';
import { capitalised, formatBytes, formatPair, lostWords, parkWords, reasonText, refusalText } from './format';
import { IState } from './state';

// --- which usage figure a bar shows ------------------------------------------------------------

/** Where a usage figure came from: NVML (whole process), the torch allocator, or nowhere (unknown). */
export type UsageSource = 'nvml' | 'allocator' | 'unknown';

export interface IUsage {
  /** Null: unknown (the monitor cannot read the device and the kernel reported nothing). */
  bytes: number | null;
  source: UsageSource;
}

/** Prefer NVML's "used" (everything the process holds), else the allocator's "reserved", else unknown. */
export function kernelDeviceUsage(device: IKernelDevice): IUsage {
  if (isNumber(device.used)) {
    return { bytes: device.used, source: 'nvml' };
  }
  if (isNumber(device.reserved)) {
    return { bytes: device.reserved, source: 'allocator' };
  }
  return { bytes: null, source: 'unknown' };
}

/** "3.2 / 10 GiB", or "unknown / 10 GiB": an unknown usage is never shown as 0. */
export function usagePair(usage: IUsage, cap: number): string {
  if (usage.bytes === null) {
    return `unknown / ${formatBytes(cap)}`;
  }
  return formatPair(usage.bytes, cap);
}

export type Level = 'ok' | 'warning' | 'over';

/** "warning" from `threshold` of the cap (0.9 by default), "over" past the cap; "ok" when unknown. */
export function usageLevel(used: number | null, cap: number, threshold = 0.9): Level {
  if (used === null) {
    return 'ok';
  }
  if (!(cap > 0)) {
    return used > 0 ? 'over' : 'ok';
  }
  const fraction = used / cap;
  if (fraction > 1) {
    return 'over';
  }
  return fraction >= threshold ? 'warning' : 'ok';
}

/** Fraction of the bar to fill, 0..1 (0 for unknown: the bar then shows as unknown, not as empty). */
export function barFraction(used: number | null, whole: number): number {
  if (used === null || !(whole > 0)) {
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

// --- the banner about the monitor ---------------------------------------------------------------

/**
 * stalled: no sample for a while (usage shown is unknown, the watchdog cannot act); error: no GPU could
 * be read; degraded: some could not; unmeasured: the server has GPUs but its monitor cannot measure
 * them (no NVML: a demo's simulated GPUs, a driver that is not loaded).
 */
export type MonitorProblem = 'stalled' | 'error' | 'degraded' | 'unmeasured';

export interface IMonitorNotice {
  problem: MonitorProblem;
  /** The server's few words about it (may be empty). */
  message: string;
  /** Its raw words, for the tooltip. */
  detail: string;
  level: Level;
}

const MONITOR_LEVELS: Record<string, [MonitorProblem, Level]> = {
  stalled: ['stalled', 'over'],
  error: ['error', 'over'],
  degraded: ['degraded', 'warning'],
  'no-gpu': ['unmeasured', 'ok']
};

/** What the sidebar must say about the monitor, or null when its figures can be trusted. */
export function monitorNotice(status: IQuotaStatus | null): IMonitorNotice | null {
  const monitor = status?.monitor;
  if (!status || !status.gpu || !monitor || !(monitor.state in MONITOR_LEVELS)) {
    return null;
  }
  const [problem, level] = MONITOR_LEVELS[monitor.state];
  const said = reasonText(status.reasons?.monitor, monitor.message);
  return { problem, message: said?.words || '', detail: said?.detail || '', level };
}

// --- the status bar ---------------------------------------------------------------------------

export interface IStatusBarInfo {
  /** "GPU 3.2 / 10 GiB", "GPU unknown / 10 GiB", or "GPU: CPU only" for a kernel given no GPU. */
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
    const nearer = barFraction(usage.bytes, device.cap) > barFraction(bestUsage.bytes, best.cap);
    if ((bestUsage.bytes === null && usage.bytes !== null) || (usage.bytes !== null && nearer)) {
      best = device;
      bestUsage = usage;
    }
  }
  return {
    text: `GPU ${usagePair(bestUsage, best.cap)}`,
    level: usageLevel(bestUsage.bytes, best.cap, threshold),
    kernel,
    device: best,
    usage: bestUsage
  };
}

// --- the one line a kernel row says about itself ------------------------------------------------------

export interface IKernelLine {
  /** cpu-only: it holds no GPU; not-parkable: parking cannot work for it; park: its park state. */
  kind: 'cpu-only' | 'not-parkable' | 'park';
  /** The few words (for cpu-only: the reason, which the row puts after its label). */
  words: string;
  /** The raw detail for the tooltip ("" when there is none). */
  detail: string;
  level: Level;
  state: string;
}

/** The level of a park state's line: a lost kernel in the error colour, a wait (told or not) in the warning one. */
const PARK_LEVELS: Partial<Record<string, Level>> = { lost: 'over', waiting: 'warning' };

/**
 * One line per row, one reason at most: why it runs without a GPU, else why it cannot be parked, else its
 * park state (a waiting resume in the warning colour, with how long, the limit and what it waits for; a
 * lost kernel in the error colour, with what the user can still do). The server's short words first; its
 * raw words on hover. Null for a kernel of a server that does not park and has a GPU.
 */
export function kernelLine(kernel: IKernelStatus): IKernelLine | null {
  const park = kernel.park || null;
  if (kernel.devices.length === 0) {
    const said = reasonText(kernel.reasons?.cpu_only, kernel.cpu_only_reason);
    return { kind: 'cpu-only', words: said?.words || '', detail: said?.detail || '', level: 'ok', state: 'cpu-only' };
  }
  if (!park) {
    return null;
  }
  // Its process ended while parked and jupyter_server restarted it: that is its news until its next cell said it.
  const lost = lostWords(park.lost);
  if (lost) {
    return { kind: 'park', words: lost, detail: park.lost?.words || '', level: 'over', state: 'lost' };
  }
  const said = reasonText(kernel.reasons?.park, park.reason);
  // A lost kernel is not parkable either (the server says so), but "not parkable" is not its news.
  if (park.parkable === false && park.state !== ParkState.LOST) {
    const words = said?.words || '';
    return { kind: 'not-parkable', words, detail: said?.detail || '', level: 'ok', state: park.state };
  }
  return {
    kind: 'park',
    words: parkWords(park, said?.words),
    detail: said?.detail || '',
    level: PARK_LEVELS[park.state] || 'ok',
    state: park.state
  };
}

// --- which of the Park / Resume buttons a kernel row offers -----------------------------------------

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

export const WAITING_TITLE =
  'Waiting for device memory: it comes back as soon as there is room for it ' +
  '(the broker makes room by parking idle kernels)';

/**
 * Park when parkable and not parked; Resume when parked; Resume shown but disabled while it waits for device
 * memory or is resuming (asking again brings nothing sooner); a kernel that cannot be parked shows Park
 * disabled with the server's reason as its tooltip. A lost kernel neither: nothing can bring its GPU memory
 * back, only a restart or a shutdown helps it. No park object (a server that does not park): neither button.
 */
export function parkButtons(park: IKernelPark | null | undefined): IParkButtons {
  if (!park || park.state === ParkState.LOST) {
    return { park: HIDDEN, resume: HIDDEN };
  }
  if (park.parkable === false) {
    const why = reasonText(null, park.reason)?.words || 'not parkable';
    return { park: { visible: true, enabled: false, title: why }, resume: HIDDEN };
  }
  switch (park.state) {
    case ParkState.BUSY:
    case ParkState.IDLE:
      return { park: { visible: true, enabled: true, title: PARK_TITLE }, resume: HIDDEN };
    case ParkState.PENDING:
    case ParkState.PARKING:
      return { park: { visible: true, enabled: false, title: parkWords(park) }, resume: HIDDEN };
    case ParkState.PARKED:
      return { park: HIDDEN, resume: { visible: true, enabled: true, title: RESUME_TITLE } };
    case ParkState.WAITING:
      return { park: HIDDEN, resume: { visible: true, enabled: false, title: WAITING_TITLE } };
    case ParkState.RESUMING:
      return { park: HIDDEN, resume: { visible: true, enabled: false, title: 'resuming' } };
    default:
      return { park: HIDDEN, resume: HIDDEN };
  }
}

/**
 * Whether a row offers the cap's field and buttons: not for a kernel without a GPU (nothing to cap), nor for a
 * lost one (no GPU call of it will return: only a restart or a shutdown helps it).
 */
export function offersCap(kernel: IKernelStatus): boolean {
  return kernel.devices.length > 0 && kernel.park?.state !== ParkState.LOST;
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
  return { text: capitalised(parkWords(park)), level: 'ok' };
}
