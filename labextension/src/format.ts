/**
 * Pure formatting helpers: bytes and ages as a person reads them. No JupyterLab imports, so the
 * unit tests run in plain Node.
 */

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
