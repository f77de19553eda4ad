/**
 * The usage history in the sidebar: answers read defensively, merged incrementally (only points after the
 * last, bounded as the server bounds them, kernels the server dropped dropped), stale answers ignored; and
 * the chart drawn from it: gaps for unknown figures and missing samples, steps for the cap, park bands (parked,
 * waiting for device memory, lost).
 */
import { bandOf, chartOf, chartSummary, CHART_HEIGHT, CHART_WIDTH } from '../src/chart';
import { IHistoryPoint, normalizeHistory, PARK_STATES } from '../src/contract';
import { EMPTY_HISTORY, INITIAL_STATE, mergeHistory, reduce } from '../src/state';

const GiB = 1024 ** 3;

function point(t: number, extra: Partial<IHistoryPoint> = {}): IHistoryPoint {
  return {
    t, used: 2 * GiB, allocated: GiB, reserved: 1.5 * GiB, cap: 10 * GiB, hard_limit: null, park: 'idle', ...extra
  };
}

function answer(kernels: Record<string, IHistoryPoint[]>, points_max = 5) {
  return { interval: 1, points_max, kernels };
}

describe('normalizeHistory', () => {
  it('keeps whole points in time order and drops junk', () => {
    const read = normalizeHistory({
      interval: 2,
      points_max: 300,
      kernels: {
        a: [point(3), { t: 'x' }, null, point(1, { used: 'lots' as any, park: 'sleeping' as any })],
        b: 'junk'
      }
    });
    expect(read.interval).toBe(2);
    expect(read.kernels.a.map(p => p.t)).toEqual([1, 3]);
    expect(read.kernels.a[0]).toMatchObject({ used: null, park: 'idle' });
    expect(read.kernels.b).toEqual([]);
    expect(normalizeHistory(null)).toEqual({ interval: 1, points_max: 300, kernels: {} });
  });
});

describe('mergeHistory', () => {
  it('adds only newer points, bounded by points_max', () => {
    let history = mergeHistory(EMPTY_HISTORY, answer({ a: [point(1), point(2), point(3)] }), 1, true);
    expect(history.kernels.a.map(p => p.t)).toEqual([1, 2, 3]);
    expect(history.last).toBe(3);
    // An incremental answer that repeats a point it already has (a since of the same time) adds it once.
    history = mergeHistory(history, answer({ a: [point(3), point(4), point(5), point(6), point(7)] }), 2, false);
    expect(history.kernels.a.map(p => p.t)).toEqual([3, 4, 5, 6, 7]);
    expect(history.last).toBe(7);
  });

  it('drops kernels the server no longer lists, keeps those with nothing new', () => {
    let history = mergeHistory(EMPTY_HISTORY, answer({ a: [point(1)], b: [point(1)] }), 1, true);
    history = mergeHistory(history, answer({ a: [] }), 2, false);
    expect(Object.keys(history.kernels)).toEqual(['a']);
    expect(history.kernels.a.map(p => p.t)).toEqual([1]);
    expect(history.last).toBe(1);
  });

  it('ignores an answer overtaken by a later one', () => {
    const later = mergeHistory(EMPTY_HISTORY, answer({ a: [point(5)] }), 2, true);
    expect(mergeHistory(later, answer({ a: [point(1)] }), 1, true)).toBe(later);
    const state = reduce(INITIAL_STATE, { type: 'history', seq: 1, full: true, answer: answer({ a: [point(1)] }) });
    expect(state.history.kernels.a).toHaveLength(1);
    expect(reduce(state, { type: 'history', seq: 1, full: true, answer: answer({}) })).toBe(state);
  });
});

describe('chartOf', () => {
  const ten = Array.from({ length: 10 }, (_, i) => point(100 + i));

  it('draws the window, the newest point at the right edge', () => {
    const chart = chartOf(ten, 109, 10, 1);
    expect(chart.known).toBe(true);
    expect(chart.points).toHaveLength(10);
    const xs = [...chart.used.matchAll(/[ML]([\d.]+) /g)].map(m => Number(m[1]));
    expect(Math.max(...xs)).toBe(CHART_WIDTH);
    expect(Math.min(...xs)).toBe(CHART_WIDTH / 10); // t=100 in a 10 s window from 99 to 109
    // The top of the box holds the largest figure with room: the cap is near the top, inside it.
    expect(chart.yMax).toBeGreaterThan(10 * GiB);
    const capY = Number(/^M[\d.]+ ([\d.]+)/.exec(chart.cap)![1]);
    expect(capY).toBeGreaterThan(0);
    expect(capY).toBeLessThan(CHART_HEIGHT / 4);
  });

  it('leaves a gap where NVML could not tell, instead of a drop to 0', () => {
    const points = ten.map(p => (p.t === 104 || p.t === 105 ? { ...p, used: null } : p));
    const chart = chartOf(points, 109, 10, 1);
    expect(chart.used.split('M')).toHaveLength(3); // two runs
    const ys = [...chart.used.matchAll(/[ML][\d.]+ ([\d.]+)/g)].map(m => Number(m[1]));
    expect(Math.max(...ys)).toBeLessThan(CHART_HEIGHT - 2); // nothing drawn at the 0 line
  });

  it('leaves a gap where samples are missing (a stalled monitor)', () => {
    const points = [point(100), point(101), point(108), point(109)];
    expect(chartOf(points, 109, 10, 1).used.split('M')).toHaveLength(3);
  });

  it('says usage unknown when nothing in the window is known, yet draws the cap', () => {
    const points = ten.map(p => ({ ...p, used: null, allocated: null, reserved: null }));
    const chart = chartOf(points, 109, 10, 1);
    expect(chart.known).toBe(false);
    expect(chart.used).toBe('');
    expect(chart.allocated).toBe('');
    expect(chart.cap).not.toBe('');
    expect(chartSummary(chart)).toContain('NVML used: unknown');
  });

  it('draws a cap change as a step and marks park periods', () => {
    const points = ten.map(p =>
      p.t >= 105 ? { ...p, cap: 5 * GiB, park: p.t <= 107 ? ('parked' as const) : ('idle' as const), used: 0 } : p
    );
    const chart = chartOf(points, 109, 10, 1);
    expect(chart.cap).toContain('V');
    expect(chart.parks).toHaveLength(1);
    expect(chart.parks[0]).toMatchObject({ state: 'parked', from: 105, to: 107 });
    expect(chart.parks[0].width).toBeGreaterThan(0);
    const waiting = chartOf(ten.map(p => (p.t === 109 ? { ...p, park: 'waiting' as const } : p)), 109, 10, 1);
    expect(waiting.parks.map(b => b.state)).toEqual(['waiting']);
    expect(chartSummary(chart).some(line => line.startsWith('Parked: '))).toBe(true);
  });

  it('shows a hard limit only when the kernel has one', () => {
    expect(chartOf(ten, 109, 10, 1).hardLimit).toBe('');
    const hard = chartOf(ten.map(p => ({ ...p, hard_limit: 10.5 * GiB })), 109, 10, 1);
    expect(hard.hardLimit).not.toBe('');
    expect(chartSummary(hard).join('\n')).toContain('Hard limit (dotted): 10.5 GiB');
  });

  it('keeps points outside the window out', () => {
    const chart = chartOf([point(1), ...ten], 109, 10, 1);
    expect(chart.points[0].t).toBe(100);
  });
});

describe('the chart of a kernel that waited, then was lost', () => {
  const point = (t: number, state: IHistoryPoint['park']): IHistoryPoint => ({
    t,
    used: state === 'idle' ? 4 * GiB : 0,
    allocated: null,
    reserved: null,
    cap: 20 * GiB,
    hard_limit: null,
    park: state
  });
  // 100-103 on the device, 104-105 parked, 106-107 waiting, 108 resuming, 109-111 lost.
  const states: IHistoryPoint['park'][] = ['idle', 'idle', 'idle', 'idle', 'parked', 'parked', 'waiting', 'waiting'];
  const points = [...states, 'resuming', 'lost', 'lost', 'lost'].map((s, i) => point(100 + i, s as any));

  it('marks each period with its own band: parked, waiting, parked (resuming), lost', () => {
    const chart = chartOf(points, 111, 12, 1);
    expect(chart.parks.map(b => [b.state, b.from, b.to])).toEqual([
      ['parked', 104, 105],
      ['waiting', 106, 107],
      ['parked', 108, 108],
      ['lost', 109, 111]
    ]);
    const lost = chart.parks[3];
    expect(lost.x + lost.width).toBeLessThanOrEqual(300);
    const said = chartSummary(chart);
    expect(said.filter(line => line.startsWith('Waiting for device memory: '))).toHaveLength(1);
    expect(said[said.length - 1]).toMatch(/^Lost \(its GPU memory could not be brought back\): \d\d:\d\d–\d\d:\d\d$/);
  });

  it('draws a band for every park state but the ones on the device', () => {
    expect(PARK_STATES.map(s => [s, bandOf(s)])).toEqual([
      ['busy', null],
      ['idle', null],
      ['pending', null],
      ['parking', 'parked'],
      ['parked', 'parked'],
      ['resuming', 'parked'],
      ['waiting', 'waiting'],
      ['lost', 'lost']
    ]);
  });
});
