/**
 * A kernel's usage over the last minutes as a small chart, as pure functions: the geometry of an SVG that
 * our own code draws (paths in a fixed box that the row stretches to its width): the allocator's allocated
 * and reserved as areas, NVML's used as a line, the cap and the hard limit as steps, park periods as bands
 * (parked, waiting for device memory, lost);
 * a gap where a figure is unknown or samples are missing, never a drop to 0. And what it shows, in words,
 * for its tooltip. No JupyterLab imports, no DOM.
 */

import { IHistoryPoint, ParkState } from './contract';
import { formatBytes, formatClock, formatDuration } from './format';

/** The box the paths are drawn in (the SVG's viewBox); the row stretches it to its width. */
export const CHART_WIDTH = 300;
export const CHART_HEIGHT = 40;
const PAD = 1.5; // so that a line at the top or at 0 is not cut in half

/** Park states whose period the chart marks: the kernel's GPU memory is (going) on the host. */
const PARKED: ReadonlySet<string> = new Set([ParkState.PARKING, ParkState.PARKED, ParkState.RESUMING]);

/** What a band marks: parked (parking, parked, resuming), waiting (a resume waiting for device memory), or
 * lost (its restore failed: what was on the GPU is gone). */
export type BandState = 'parked' | 'waiting' | 'lost';

/** The band a park state draws, or null for a kernel on its device (busy, idle, pending). */
export function bandOf(park: string): BandState | null {
  if (park === ParkState.WAITING || park === ParkState.LOST) {
    return park;
  }
  return PARKED.has(park) ? 'parked' : null;
}

export interface IParkBand {
  x: number;
  width: number;
  state: BandState;
  /** The server's times of its first and last points. */
  from: number;
  to: number;
}

export interface IChart {
  /** The window shown: its start and end on the server's clock (seconds), and its length. */
  start: number;
  end: number;
  seconds: number;
  /** The size at the top of the box. */
  yMax: number;
  allocated: string;
  reserved: string;
  used: string;
  cap: string;
  hardLimit: string;
  parks: IParkBand[];
  /** Whether any usage figure (NVML or the allocator's) in the window is known. */
  known: boolean;
  /** The points in the window, oldest first. */
  points: IHistoryPoint[];
}

type Figure = 'used' | 'allocated' | 'reserved' | 'cap' | 'hard_limit';

const round = (value: number): number => Math.round(value * 10) / 10;

/** Runs of consecutive points (no sample missing between them) whose `figure` is known. */
function runs(points: IHistoryPoint[], figure: Figure, gap: number): IHistoryPoint[][] {
  const found: IHistoryPoint[][] = [];
  let run: IHistoryPoint[] = [];
  let previous: IHistoryPoint | null = null;
  for (const point of points) {
    const broken = previous !== null && point.t - previous.t > gap;
    if (point[figure] === null || broken) {
      if (run.length) {
        found.push(run);
      }
      run = [];
    }
    if (point[figure] !== null) {
      run.push(point);
    }
    previous = point;
  }
  if (run.length) {
    found.push(run);
  }
  return found;
}

/**
 * The chart of `points` (one kernel's, oldest first) over the `seconds` before `end` (the server's time of
 * its newest sample), `interval` seconds apart: a gap of more than a few intervals is a gap in every line.
 */
export function chartOf(points: readonly IHistoryPoint[], end: number, seconds: number, interval: number): IChart {
  const start = end - seconds;
  const shown = points.filter(p => p.t >= start && p.t <= end);
  const gap = Math.max(3 * interval, interval + 1);
  let top = 0;
  let known = false;
  for (const p of shown) {
    for (const value of [p.used, p.allocated, p.reserved, p.cap, p.hard_limit]) {
      if (value !== null && value > top) {
        top = value;
      }
    }
    known = known || p.used !== null || p.allocated !== null || p.reserved !== null;
  }
  const yMax = top > 0 ? top * 1.08 : 1;
  const x = (t: number) => round(((t - start) / seconds) * CHART_WIDTH);
  const y = (v: number) => round(CHART_HEIGHT - PAD - (v / yMax) * (CHART_HEIGHT - 2 * PAD));
  const dot = Math.max(1, round((interval / seconds) * CHART_WIDTH)); // one sample alone still shows
  const base = round(CHART_HEIGHT - PAD);

  const line = (figure: Figure): string =>
    runs(shown, figure, gap)
      .map(run => {
        const head = `M${x(run[0].t)} ${y(run[0][figure]!)}`;
        if (run.length === 1) {
          return `${head}h${dot}`;
        }
        return head + run.slice(1).map(p => `L${x(p.t)} ${y(p[figure]!)}`).join('');
      })
      .join('');

  const area = (figure: Figure): string =>
    runs(shown, figure, gap)
      .map(run => {
        const last = run[run.length - 1];
        const edge = run.length === 1 ? `L${round(x(last.t) + dot)} ${y(last[figure]!)}` : '';
        const outline = run.map(p => `L${x(p.t)} ${y(p[figure]!)}`).join('');
        const right = run.length === 1 ? round(x(last.t) + dot) : x(last.t);
        return `M${x(run[0].t)} ${base}${outline}${edge}L${right} ${base}Z`;
      })
      .join('');

  // A cap changes at once (a %gpucap): drawn as steps.
  const steps = (figure: Figure): string =>
    runs(shown, figure, gap)
      .map(run => {
        let path = `M${x(run[0].t)} ${y(run[0][figure]!)}`;
        for (let i = 1; i < run.length; i++) {
          path += `H${x(run[i].t)}V${y(run[i][figure]!)}`;
        }
        return run.length === 1 ? `${path}h${dot}` : `${path}H${x(run[run.length - 1].t)}`;
      })
      .join('');

  // Park periods: runs of points in one held state, each sample standing for the interval around it.
  const spans: { state: BandState; from: number; to: number }[] = [];
  let previous: IHistoryPoint | null = null;
  for (const p of shown) {
    const state = bandOf(p.park);
    const open = spans.length ? spans[spans.length - 1] : null;
    const continues = open !== null && previous !== null && open.to === previous.t && p.t - previous.t <= gap;
    if (state && continues && open!.state === state) {
      open!.to = p.t;
    } else if (state) {
      spans.push({ state, from: p.t, to: p.t });
    }
    previous = p;
  }
  const parks: IParkBand[] = spans.map(span => {
    const left = Math.max(0, x(span.from - interval / 2));
    const right = Math.min(CHART_WIDTH, x(span.to + interval / 2));
    return { x: left, width: round(Math.max(dot, right - left)), ...span };
  });

  return {
    start,
    end,
    seconds,
    yMax,
    allocated: area('allocated'),
    reserved: area('reserved'),
    used: line('used'),
    cap: steps('cap'),
    hardLimit: steps('hard_limit'),
    parks,
    known,
    points: shown
  };
}

function newestKnown(points: readonly IHistoryPoint[], figure: Figure): number | null {
  for (let i = points.length - 1; i >= 0; i--) {
    const value = points[i][figure];
    if (value !== null) {
      return value;
    }
  }
  return null;
}

function most(points: readonly IHistoryPoint[], figure: Figure): number | null {
  let top: number | null = null;
  for (const p of points) {
    const value = p[figure];
    if (value !== null && (top === null || value > top)) {
      top = value;
    }
  }
  return top;
}

const BAND_WORDS: Record<BandState, string> = {
  parked: 'Parked',
  waiting: 'Waiting for device memory',
  lost: 'Lost (its GPU memory could not be brought back)'
};

/** What the chart shows, in words (its tooltip and its accessible name), one fact a line. */
export function chartSummary(chart: IChart): string[] {
  const points = chart.points;
  const lines = [`Usage over the last ${formatDuration(chart.seconds)}`];
  const used = newestKnown(points, 'used');
  lines.push(
    used === null
      ? 'NVML used: unknown'
      : `NVML used (line): ${formatBytes(used)} now, at most ${formatBytes(most(points, 'used'))}`
  );
  const reserved = newestKnown(points, 'reserved');
  const allocated = newestKnown(points, 'allocated');
  lines.push(
    reserved === null && allocated === null
      ? 'Allocator: no report from the kernel'
      : `Allocator (areas): ${formatBytes(allocated)} allocated, ${formatBytes(reserved)} reserved`
  );
  const cap = newestKnown(points, 'cap');
  if (cap !== null) {
    lines.push(`Cap (dashed): ${formatBytes(cap)}`);
  }
  const hard = newestKnown(points, 'hard_limit');
  if (hard !== null) {
    lines.push(`Hard limit (dotted): ${formatBytes(hard)}`);
  }
  for (const band of chart.parks) {
    const words = BAND_WORDS[band.state];
    lines.push(`${words}: ${formatClock(band.from)}–${formatClock(band.to)}`);
  }
  return lines;
}
