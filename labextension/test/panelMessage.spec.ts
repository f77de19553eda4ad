/**
 * The sidebar's top line (panelMessage.ts): a problem with the poll or the server comes first, else what the
 * server says of its GPU monitor, else no line; the raw words on hover only when the line does not say them.
 */
import { normalizeStatus } from '../src/contract';
import { monitorNotice } from '../src/derive';
import { panelMessage } from '../src/panelMessage';
import { INITIAL_STATE, IState } from '../src/state';

const trans = {
  __: (msgid: string, ...args: any[]) => msgid.replace(/%(\d)/g, (_, n) => String(args[Number(n) - 1]))
} as any;

function state(phase: IState['phase'], raw: any, extra: Partial<IState> = {}): IState {
  return { ...INITIAL_STATE, phase, status: raw ? normalizeStatus(raw) : null, ...extra };
}

function lineFor(s: IState) {
  const status = s.phase === 'missing' || s.phase === 'no-gpu' ? null : s.status;
  return panelMessage(trans, s, monitorNotice(status));
}

describe('panelMessage', () => {
  it('says nothing while the poll is fine and the monitor measures', () => {
    expect(lineFor(state('ok', { gpu: true, devices: [], kernels: [], monitor: { state: 'ok' } }))).toEqual({
      text: '',
      title: '',
      level: 'ok',
      monitor: ''
    });
  });

  it("says what the monitor lacks, in the server's words, at the monitor's level", () => {
    const monitor = { state: 'stalled', message: 'no sample for 30 s' };
    const stalled = { gpu: true, devices: [], kernels: [], monitor };
    expect(lineFor(state('ok', stalled))).toEqual({
      text: 'GPU monitor stalled, usage unknown: no sample for 30 s',
      title: '', // the line already holds the raw words
      level: 'over',
      monitor: 'stalled'
    });
  });

  it('puts a failed poll before what the monitor says', () => {
    const degraded = { gpu: true, devices: [], kernels: [], monitor: { state: 'degraded', message: 'GPU 1 lost' } };
    const line = lineFor(state('error', degraded, { error: 'HTTP 502' }));
    expect(line).toEqual({ text: 'Cannot read GPU quotas, retrying: HTTP 502', title: '', level: 'over', monitor: '' });
  });

  it('says why there is no GPU in few words, the raw text on hover', () => {
    const raw = {
      gpu: false,
      message: 'NVML Shared Library Not Found',
      reasons: { no_gpu: { reason: 'no NVIDIA driver here', detail: 'NVML Shared Library Not Found' } },
      devices: [],
      kernels: []
    };
    expect(lineFor(state('no-gpu', raw))).toEqual({
      text: 'No GPU on this server: no NVIDIA driver here',
      title: 'NVML Shared Library Not Found',
      level: 'ok',
      monitor: ''
    });
    expect(lineFor(state('no-gpu', { gpu: false, devices: [], kernels: [] })).text).toBe('No GPU on this server.');
  });

  it('says the server extension is missing and that it is loading', () => {
    expect(lineFor(state('missing', null))).toMatchObject({
      text: 'The gpu-quota-ext server extension is not enabled on this server.',
      level: 'over'
    });
    expect(lineFor(state('loading', null))).toMatchObject({ text: 'Loading GPU quotas…', level: 'ok' });
  });
});
