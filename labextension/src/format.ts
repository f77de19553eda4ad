/**
 * What the sidebar says in words, as pure functions: bytes, ages, durations and clock times as a person
 * reads them; the server's messages shown as written (never as a format), said once and cut when long;
 * a kernel's park state and refusals in the same words as %gpucap (gpu_quota_ext/kernel/park.py).
 * No JupyterLab imports, so the unit tests run in plain Node.
 */

import { IKernelLost, IKernelPark, IReason, isNumber, ParkState } from './contract';

const UNITS = ['B', 'KiB', 'MiB', 'GiB', 'TiB', 'PiB'];

/** The binary unit a size is best read in: the largest one the size reaches. */
export function unitFor(bytes: number): number {
  let exponent = 0;
  let value = Math.abs(bytes);
  while (value >= 1024 && exponent < UNITS.length - 1) {
    value /= 1024;
    exponent += 1;
  }
  return exponent;
}

/** A number of `unit`s with one decimal under 100 and none above; "10" rather than "10.0". */
export function formatIn(bytes: number, exponent: number): string {
  const value = bytes / Math.pow(1024, exponent);
  if (value !== 0 && Math.abs(value) < 0.05) {
    return '<0.1';
  }
  const text = Math.abs(value) >= 100 ? value.toFixed(0) : value.toFixed(1);
  return text.endsWith('.0') ? text.slice(0, -2) : text;
}

/** "3.2 GiB", "512 MiB", "0 B". Unknown (null, NaN) gives "–". */
export function formatBytes(bytes: number | null | undefined): string {
  if (bytes === null || bytes === undefined || !Number.isFinite(bytes)) {
    return '–';
  }
  const exponent = unitFor(bytes);
  return `${formatIn(bytes, exponent)} ${UNITS[exponent]}`;
}

/** "3.2 / 10 GiB": both numbers in the unit of the larger one, so they compare at a glance. */
export function formatPair(part: number, whole: number): string {
  const exponent = unitFor(Math.max(part, whole));
  return `${formatIn(part, exponent)} / ${formatIn(whole, exponent)} ${UNITS[exponent]}`;
}

/** "42%" of a fraction; "–" when the whole is unknown. */
export function formatPercent(fraction: number | null): string {
  if (fraction === null || !Number.isFinite(fraction)) {
    return '–';
  }
  return `${Math.round(fraction * 100)}%`;
}

/**
 * A time the server sent (epoch seconds, epoch milliseconds or an ISO string) as epoch milliseconds,
 * or null when it cannot be read.
 */
export function toMillis(time: number | string | null | undefined): number | null {
  if (typeof time === 'number' && Number.isFinite(time)) {
    // Seconds until the year 2286; anything larger is already milliseconds.
    return time < 1e10 ? time * 1000 : time;
  }
  if (typeof time === 'string' && time) {
    const parsed = Date.parse(time);
    return Number.isNaN(parsed) ? null : parsed;
  }
  return null;
}

/** "just now", "12 s ago", "3 min ago", "2 h ago", "4 d ago". */
export function formatAge(time: number | string | null | undefined, now: number): string {
  const millis = toMillis(time);
  if (millis === null) {
    return '';
  }
  const seconds = Math.max(0, Math.round((now - millis) / 1000));
  if (seconds < 2) {
    return 'just now';
  }
  if (seconds < 60) {
    return `${seconds} s ago`;
  }
  if (seconds < 3600) {
    return `${Math.floor(seconds / 60)} min ago`;
  }
  if (seconds < 86400) {
    return `${Math.floor(seconds / 3600)} h ago`;
  }
  return `${Math.floor(seconds / 86400)} d ago`;
}

/** "40 s", "12 min", "2 h 5 min"; `exact` keeps the seconds below an hour ("1 min 40 s"), for a wait and its
 * limit (the kernel's duration_words in kernel/park.py says the same). */
export function formatDuration(seconds: number, exact = false): string {
  const s = Math.max(0, Math.floor(seconds));
  if (s < 60) {
    return `${s} s`;
  }
  if (s < 3600) {
    const minutes = Math.floor(s / 60);
    return exact && s % 60 ? `${minutes} min ${s % 60} s` : `${minutes} min`;
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

// --- what the server says in words ------------------------------------------------------------

/** The most of a server's message the sidebar shows; the rest is cut with an ellipsis. */
export const MAX_MESSAGE_CHARS = 300;

/** `text` cut to `max` characters, the last one an ellipsis when anything was cut. */
export function shorten(text: string, max = MAX_MESSAGE_CHARS): string {
  return text.length > max ? `${text.slice(0, max - 1)}…` : text;
}

/** The first letter a capital. */
export function capitalised(text: string): string {
  return text.charAt(0).toUpperCase() + text.slice(1);
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
    return capitalised(said);
  }
  return said ? `${label}: ${said}` : label;
}

/** A reason to show: its few words, and the raw detail for the tooltip. */
export interface IReasonText {
  words: string;
  detail: string;
}

const oneLine = (text: string | null | undefined): string => (text || '').trim().replace(/\s+/g, ' ');

/**
 * The words to show for a raw reason: the server's short pair when it sent one for this very text
 * (shared/reasons.py), else the raw text itself (an older server, or a reason newer than the pair: a
 * park answer's), cut when long. Null when there is nothing to say.
 */
export function reasonText(pair: IReason | null | undefined, raw: string | null | undefined): IReasonText | null {
  const said = oneLine(raw);
  const fits = pair && pair.reason && (!said || oneLine(pair.detail) === said);
  const detail = fits ? oneLine(pair!.detail) : said;
  const words = fits ? pair!.reason.trim() : said;
  if (!words) {
    return null;
  }
  return { words: shorten(words), detail: detail || words };
}

// --- parking in words -------------------------------------------------------------------------

/** What a lost kernel's line says when the server gave no reason (gpu_quota_ext/kernel/park.py's words). */
export const LOST_WORDS = 'its GPU memory could not be brought back; restart the kernel';

/**
 * A kernel's park state as the sidebar says it ("running", "idle for 12 min", "parked since 14:02,
 * 17.8 GiB on host", "resuming", "waiting for device memory for 12 s (limit 5 min): <reason>", "lost:
 * <what the user can still do>"); the same words as %gpucap (gpu_quota_ext/kernel/park.py, state_words),
 * with the wait's limit beside how long it has waited (the cell's own output says both too).
 * `reason`: the words for the server's reason (its short pair).
 */
export function parkWords(park: IKernelPark, reason?: string | null): string {
  const said = reason || (typeof park.reason === 'string' && park.reason ? shorten(park.reason) : '');
  switch (park.state) {
    case ParkState.BUSY:
      return 'running';
    case ParkState.IDLE:
      return isNumber(park.idle_seconds) ? `idle for ${formatDuration(park.idle_seconds)}` : 'idle';
    case ParkState.PENDING:
      return 'parks when its current cell ends';
    case ParkState.PARKING:
      return 'parking: its GPU memory is moving to host memory';
    case ParkState.PARKED: {
      let words = 'parked';
      const since = formatClock(park.since);
      if (since) {
        words += ` since ${since}`;
      }
      if (isNumber(park.host_bytes)) {
        words += `, ${formatBytes(park.host_bytes)} on host`;
      }
      // The fast park leaves the CUDA context behind: the user sees it in nvidia-smi, so it is said.
      if (park.path && park.path.path === 'pages' && isNumber(park.path.stays_on_device)) {
        words += ` (fast park: ${formatBytes(park.path.stays_on_device)} stays on the GPU)`;
      }
      return words;
    }
    case ParkState.RESUMING:
      return 'resuming';
    case ParkState.WAITING:
      return park.told === true ? toldWords(park) : waitingWords(park, said);
    case ParkState.LOST:
      return `lost: ${said || LOST_WORDS}`;
    default:
      return String(park.state || 'unknown');
  }
}

/**
 * A kernel restarted because its process ended while parked (the server's "park"."lost"), as its row says it
 * until its next cell has said it too: "restarted at 01:23: its process ended while parked (killed by SIGKILL:
 * ...); its variables and GPU memory are gone: run the notebook's cells again". "" when there is no such news.
 */
export function lostWords(lost: IKernelLost | null | undefined): string {
  if (!lost || typeof lost !== 'object' || typeof lost.why !== 'string' || !lost.why) {
    return '';
  }
  const at = formatClock(lost.at);
  const when = at ? `restarted at ${at}` : 'restarted';
  return `${when}: ${lost.why}; its variables and GPU memory are gone: run the notebook's cells again`;
}

/** "5 min" of the wait's limit, or "" when there is none (park_wait_limit "off") or it is unknown. */
function limitWords(park: IKernelPark): string {
  return isNumber(park.wait_limit) && park.wait_limit > 0 ? formatDuration(park.wait_limit, true) : '';
}

/** "waiting for device memory for 12 s (limit 5 min): <reason>": how long, the limit, what for. */
function waitingWords(park: IKernelPark, said: string): string {
  if (said.toLowerCase().startsWith('waiting for device memory')) {
    return said; // an older server's reason already says it
  }
  let words = 'waiting for device memory';
  if (isNumber(park.waited) && park.waited >= 1) {
    words += ` for ${formatDuration(park.waited, true)}`;
  }
  const limit = limitWords(park);
  if (limit) {
    words += ` (limit ${limit})`;
  }
  return said ? `${words}: ${said}` : words;
}

/**
 * Its wait passed the limit: the cell that waited ends without running (the kernel side says so in the
 * cell's output), nothing is lost, the kernel stays parked with its grant. What it waited for is the
 * server's reason, on hover.
 */
function toldWords(park: IKernelPark): string {
  const limit = limitWords(park);
  const passed = limit ? `waited past its limit (${limit})` : 'waited past its limit';
  return `${passed}: the cell did not run; the kernel stays parked with its grant`;
}

// Openings that already say the server refused: said once ("not parkable: MPS client", never
// "Cannot park: not parkable: MPS client"). The same list as gpu_quota_ext/kernel/park.py.
const REFUSAL_OPENINGS = ['cannot park', 'cannot resume', 'not parkable', 'not parked', 'did not park', 'not resumed'];

/** The server's refusal of a park or resume, as written and said once, capitalised. */
export function refusalText(message: string | null | undefined, action: 'park' | 'resume'): string {
  const said = oneLine(message);
  if (REFUSAL_OPENINGS.some(opening => said.toLowerCase().startsWith(opening))) {
    return capitalised(shorten(said));
  }
  return said ? `Cannot ${action}: ${shorten(said)}` : `Cannot ${action}`;
}

/** Why a kernel cannot be parked, "Not parkable" said once whether or not the server's reason says it. */
export function notParkableText(reason: string | null | undefined): string {
  const said = oneLine(reason);
  if (!said) {
    return 'Not parkable';
  }
  if (REFUSAL_OPENINGS.some(opening => said.toLowerCase().startsWith(opening))) {
    return shorten(capitalised(said));
  }
  return `Not parkable: ${shorten(said)}`;
}
