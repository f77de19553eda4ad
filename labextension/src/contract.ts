/**
 * The server's REST contract as the sidebar reads it: the types of GET /api/gpu-quota/status and of the
 * usage history routes, the park routes' names, and the normalization of each answer (so that optional
 * fields may be missing and the view can rely on lists being lists). Mirrors gpu_quota_ext/shared/contract.py
 * (tests/unit/test_contract_types.py checks the names). No JupyterLab imports.
 */

// --- GET /api/gpu-quota/status (fields marked ? may be missing) -------------------------------------

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
  /** Inside a pod given part of this GPU: where the pod's share (the total) came from; null: the whole GPU. */
  share?: IDeviceShare | null;
}

/** A pod's share of one device (HAMi, HAMi-DRA, KAI fractions, NVIDIA's DRA driver). */
export interface IDeviceShare {
  /** "hami", "hami-dra", "kai" or "nvidia-dra". */
  way: string;
  bytes: number;
  /** The variable or annotation read, e.g. "CUDA_DEVICE_MEMORY_LIMIT_0=20480m". */
  source: string;
  /** The layer that holds the pod to it; null: nothing below the extension does. */
  enforced_by: string | null;
  /** "pod": all the pod's processes together; "process": each process alone (an MPS limit). */
  scope: string;
}

export interface IKernelDevice {
  index: number;
  cap: number;
  max_cap?: number;
  policy_cap?: number;
  /** NVML: the kernel's whole process tree on this device; null: unknown. */
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

/** A kernel's `layers` (sizes in bytes, keyed by server device). */
export interface IKernelLayers {
  soft?: boolean;
  /** The server's c.GpuQuota.hard_cap: "off", "auto" or "mps". */
  hard_cap?: string;
  hard_limit?: { mps?: Record<string, number> } | null;
  hard_usable?: Record<string, number> | null;
  hard_reason?: string | null;
  restart_needed?: boolean;
}

/** A raw reason said again in a few plain words (shared/reasons.py): the words first, the raw text on hover. */
export interface IReason {
  reason: string;
  detail: string;
}

/** The status answer's `reasons`: each null when there is nothing to explain. */
export interface IStatusReasons {
  /** The top-level `message`: why the server has no GPU. */
  no_gpu?: IReason | null;
  /** The monitor's `message`: what keeps it from measuring. */
  monitor?: IReason | null;
}

/** Each kernel's `reasons`. */
export interface IKernelReasons {
  /** `cpu_only_reason`: why it holds no GPU. */
  cpu_only?: IReason | null;
  /** `park.reason`: why not parkable, why it did not park, what a waiting resume waits for. */
  park?: IReason | null;
  /** `layers.hard_reason`: why the driver enforces no hard limit for it. */
  hard_limit?: IReason | null;
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
  reasons?: IKernelReasons | null;
}

// --- parking: each kernel's "park" object, and the park / resume routes -----------------------------

/** POST kernels/<id>/park: park once the current cell has finished; /resume: bring it back now. */
export const PARK_SUFFIX = 'park';
export const RESUME_SUFFIX = 'resume';

/**
 * A kernel's park state: the names and words of gpu_quota_ext/shared/park_state.py `ParkState`, in its order
 * (a test checks both lists). The contract's PARK_STATES are its words.
 */
export const ParkState = {
  BUSY: 'busy',
  IDLE: 'idle',
  PENDING: 'pending',
  PARKING: 'parking',
  PARKED: 'parked',
  RESUMING: 'resuming',
  WAITING: 'waiting',
  LOST: 'lost'
} as const;
export type ParkState = (typeof ParkState)[keyof typeof ParkState];
export const PARK_STATES: readonly ParkState[] = Object.values(ParkState);

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
  /** Why not parkable, why it did not park, or what a waiting resume waits for (raw). */
  reason?: string | null;
  /** Seconds it has waited for room (waiting). */
  waited?: number | null;
  /** Seconds a cell waits for room before it is told (park_wait_limit); null: no limit. */
  wait_limit?: number | null;
  /** True once its wait passed the limit. */
  told?: boolean;
  /** A running kernel that found the GPU full and asked for room: "asking", then "made" or "told". */
  room?: 'asking' | 'made' | 'told' | null;
  /** Its process ended while parked and jupyter_server restarted it: said until its next cell has said it. */
  lost?: IKernelLost | null;
  /** fast_park on: how its current or last park goes (null before one, or with fast_park off). */
  path?: IKernelParkPath | null;
}

/** Which way a kernel parks (gpu_quota_ext/parking/path.py), and what that leaves on the device. */
export interface IKernelParkPath {
  /** "pages": the fast park library's copy; "checkpoint": the driver's checkpoint calls. */
  path: 'pages' | 'checkpoint';
  /** Why this path, in words. */
  reason: string;
  /** Bytes a park leaves on the device (pages: its CUDA context), counted as still held there. */
  stays_on_device: number;
  /** pages: the library's copy to the host, in seconds, as the kernel timed it. */
  park_seconds?: number | null;
  /** pages: its copy back, in seconds; null until a resume. */
  resume_seconds?: number | null;
  /** pages: of resume_seconds, the wait for a park under way to free its room (a swap); null until a resume. */
  resume_waited_seconds?: number | null;
}

/** A kernel restarted because its process ended while parked (gpu_quota_ext/parking/lost.py). */
export interface IKernelLost {
  /** When the server saw the process dead, wall clock in seconds. */
  at: number;
  /** "its process ended while parked (killed by SIGKILL: ...)". */
  why: string;
  /** The whole line its next cell says. */
  words: string;
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
  reasons?: IStatusReasons | null;
  /** Parking's account of the host's memory; absent from servers older than it. */
  host_memory?: IHostMemory | null;
}

/** The host's memory as parking counts it (bytes; null: unknown or no limit). */
export interface IHostMemory {
  available: number | null;
  cgroup_room: number | null;
  /** Promised to parks under way and not yet in `available`. */
  promised: number;
  /** Parked kernels' GPU memory now on the host. */
  parked: number;
  margin: number;
  /** Host memory ran short with kernels parked: nothing parks, parked kernels come back where there is room. */
  short: boolean;
  short_since: number | null;
  reason: string | null;
  short_episodes: number;
}

// --- the usage history: GET history?since=T, GET kernels/<id>/history?since=T ------------------------

export const HISTORY_SUFFIX = 'history';
export const HISTORY_SINCE = 'since';

/** One kernel at one monitor sample; sizes in bytes summed over its devices, null where unknown. */
export interface IHistoryPoint {
  /** Wall clock (seconds, the server's) when the sample came in. */
  t: number;
  /** NVML: the kernel's processes. */
  used: number | null;
  /** The kernel's last allocator report. */
  allocated: number | null;
  reserved: number | null;
  cap: number | null;
  /** The driver's limit (MPS, with the CUDA context), null when it has none. */
  hard_limit: number | null;
  park: ParkState;
}

export interface IHistoryAnswer {
  /** Seconds between points. */
  interval: number;
  /** The most points the server keeps per kernel. */
  points_max: number;
  /** Every kernel the server keeps a history for, its points newer than `since`. */
  kernels: Record<string, IHistoryPoint[]>;
}

export interface IKernelHistoryAnswer {
  interval: number;
  points_max: number;
  points: IHistoryPoint[];
}

// --- normalization: what the view may rely on -----------------------------------------------------

export const isNumber = (value: unknown): value is number =>
  typeof value === 'number' && Number.isFinite(value);

const sizeOrNull = (value: unknown): number | null => (isNumber(value) ? value : null);

function reasonOrNull(value: any): IReason | null {
  return value && typeof value === 'object' && typeof value.reason === 'string' && value.reason
    ? { reason: value.reason, detail: typeof value.detail === 'string' ? value.detail : value.reason }
    : null;
}

function reasonsOf<K extends string>(raw: any, keys: readonly K[]): Record<K, IReason | null> {
  const data = raw && typeof raw === 'object' ? raw : {};
  const out = {} as Record<K, IReason | null>;
  for (const key of keys) {
    out[key] = reasonOrNull(data[key]);
  }
  return out;
}

/** The status reply as the view may rely on it: lists always present, numbers numbers, reasons pairs. */
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
              : null,
          reasons: reasonsOf(k.reasons, ['cpu_only', 'park', 'hard_limit'] as const)
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
    monitor,
    reasons: reasonsOf(data.reasons, ['no_gpu', 'monitor'] as const)
  };
}

function normalizePoints(raw: unknown): IHistoryPoint[] {
  if (!Array.isArray(raw)) {
    return [];
  }
  const points: IHistoryPoint[] = [];
  for (const p of raw) {
    if (!p || typeof p !== 'object' || !isNumber(p.t)) {
      continue;
    }
    points.push({
      t: p.t,
      used: sizeOrNull(p.used),
      allocated: sizeOrNull(p.allocated),
      reserved: sizeOrNull(p.reserved),
      cap: sizeOrNull(p.cap),
      hard_limit: sizeOrNull(p.hard_limit),
      park: (PARK_STATES as readonly string[]).includes(p.park) ? p.park : ParkState.IDLE
    });
  }
  // In time order, as the server keeps them (a reply is not trusted to be).
  return points.sort((a, b) => a.t - b.t);
}

/** GET history as the chart may rely on it: a positive interval, whole points, each list in time order. */
export function normalizeHistory(raw: any): IHistoryAnswer {
  const data = raw && typeof raw === 'object' ? raw : {};
  const kernels: Record<string, IHistoryPoint[]> = {};
  if (data.kernels && typeof data.kernels === 'object' && !Array.isArray(data.kernels)) {
    for (const [id, points] of Object.entries(data.kernels)) {
      kernels[id] = normalizePoints(points);
    }
  }
  return {
    interval: isNumber(data.interval) && data.interval > 0 ? data.interval : 1,
    points_max: isNumber(data.points_max) && data.points_max >= 1 ? Math.floor(data.points_max) : 300,
    kernels
  };
}
