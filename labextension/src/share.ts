/**
 * One poll shared between the tabs of a browser: the status another tab fetched from the same server, and
 * whether a tick may show it instead of asking the server. Pure: no JupyterLab imports.
 */

import { IQuotaStatus } from './contract';

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
