import { IKernelStatus, normalizeStatus } from '../src/contract';
import { barFraction, kernelDeviceUsage, monitorNotice, sortKernels, statusBarInfo, usageLevel } from '../src/derive';
import { labelled, MAX_MESSAGE_CHARS, serverMessage } from '../src/format';
import { INITIAL_STATE, IState, reduce } from '../src/state';

const GiB = 1024 ** 3;

function kernel(id: string, path: string | null, extra: Partial<IKernelStatus> = {}): IKernelStatus {
  return {
    id,
    path,
    kernelspec: 'python3',
    devices: [{ index: 0, cap: 10 * GiB, max_cap: 80 * GiB, policy_cap: 10 * GiB }],
    ...extra
  };
}

/** What the server sends today: no monitor fields at all. */
const TODAY = {
  gpu: true,
  message: null,
  user: 'alice',
  devices: [
    { index: 0, name: 'Test GPU 0', uuid: 'static-0', total: 80 * GiB, budget: null, granted: 20 * GiB, kernels: 2 }
  ],
  kernels: [
    {
      id: 'k1',
      user: 'alice',
      kernelspec: 'python3',
      path: 'b.ipynb',
      source: 'default',
      placed: true,
      cpu_only_reason: null,
      devices: [{ index: 0, cap: 10 * GiB, max_cap: 80 * GiB, policy_cap: 10 * GiB }]
    }
  ],
  policy: { default_cap: '0.25' }
};

describe('normalizeStatus', () => {
  it('keeps a reply without monitor fields as it is', () => {
    const status = normalizeStatus(TODAY);
    expect(status.gpu).toBe(true);
    expect(status.kernels[0].devices[0].cap).toBe(10 * GiB);
    expect(status.kernels[0].last_action).toBeUndefined();
  });

  it('tolerates missing lists and junk entries', () => {
    const status = normalizeStatus({ gpu: false, message: 'no GPU: NVML library not found' });
    expect(status).toMatchObject({ gpu: false, devices: [], kernels: [], message: 'no GPU: NVML library not found' });
    const junk = normalizeStatus({ gpu: true, kernels: [null, { id: 'x' }, { id: 'y', devices: [{ index: 0 }] }] });
    expect(junk.kernels.map(k => k.devices.length)).toEqual([0, 0]);
    expect(normalizeStatus(null)).toMatchObject({ gpu: false, devices: [], kernels: [] });
  });

  it('names an unnamed device', () => {
    expect(normalizeStatus({ gpu: true, devices: [{ index: 1, total: 5 }] }).devices[0].name).toBe('GPU 1');
  });
});

describe('kernelDeviceUsage', () => {
  it('prefers NVML, then the allocator, then says it does not know', () => {
    expect(kernelDeviceUsage({ index: 0, cap: 1, used: 7, reserved: 5 })).toEqual({ bytes: 7, source: 'nvml' });
    expect(kernelDeviceUsage({ index: 0, cap: 1, used: null, reserved: 5 })).toEqual({ bytes: 5, source: 'allocator' });
    expect(kernelDeviceUsage({ index: 0, cap: 1 })).toEqual({ bytes: null, source: 'unknown' });
    expect(kernelDeviceUsage({ index: 0, cap: 1, used: 0 })).toEqual({ bytes: 0, source: 'nvml' }); // 0 is known
  });
});

describe('usageLevel', () => {
  it('warns from the threshold and flags past the cap', () => {
    expect(usageLevel(8.9 * GiB, 10 * GiB)).toBe('ok');
    expect(usageLevel(9 * GiB, 10 * GiB)).toBe('warning');
    expect(usageLevel(10 * GiB, 10 * GiB)).toBe('warning');
    expect(usageLevel(10.1 * GiB, 10 * GiB)).toBe('over');
    expect(usageLevel(5 * GiB, 10 * GiB, 0.5)).toBe('warning');
    expect(usageLevel(0, 0)).toBe('ok');
    expect(usageLevel(1, 0)).toBe('over');
  });

  it('bars stay within 0..1', () => {
    expect(barFraction(5, 10)).toBe(0.5);
    expect(barFraction(50, 10)).toBe(1);
    expect(barFraction(-1, 10)).toBe(0);
    expect(barFraction(1, 0)).toBe(0);
  });
});

describe('sortKernels', () => {
  const kernels = [kernel('z', null), kernel('c', 'c.ipynb'), kernel('a', 'a.ipynb'), kernel('y', null)];

  it('puts the current kernel first, then notebooks by path, then the rest by id', () => {
    expect(sortKernels(kernels, 'y').map(k => k.id)).toEqual(['y', 'a', 'c', 'z']);
    expect(sortKernels(kernels, null).map(k => k.id)).toEqual(['a', 'c', 'y', 'z']);
    expect(sortKernels(kernels, 'gone').map(k => k.id)).toEqual(['a', 'c', 'y', 'z']);
  });

  it('does not change its input', () => {
    sortKernels(kernels, 'y');
    expect(kernels.map(k => k.id)).toEqual(['z', 'c', 'a', 'y']);
  });
});

describe('reduce', () => {
  const status = normalizeStatus(TODAY);
  const withCurrent = (id: string | null): IState => reduce(INITIAL_STATE, { type: 'current', kernelId: id });

  it('applies an answer for the current kernel', () => {
    const state = reduce(withCurrent('k1'), { type: 'status', seq: 1, kernelId: 'k1', status });
    expect(state).toMatchObject({ phase: 'ok', seq: 1, error: null });
    expect(state.status).toBe(status);
  });

  it('drops an answer asked for a kernel no longer current', () => {
    let state = withCurrent('k1');
    state = reduce(state, { type: 'current', kernelId: 'k2' });
    const after = reduce(state, { type: 'status', seq: 1, kernelId: 'k1', status });
    expect(after).toBe(state);
    expect(after.phase).toBe('loading');
  });

  it('drops an answer overtaken by a later one', () => {
    let state = reduce(withCurrent(null), { type: 'status', seq: 2, kernelId: null, status });
    const older = normalizeStatus({ ...TODAY, kernels: [] });
    const after = reduce(state, { type: 'status', seq: 1, kernelId: null, status: older });
    expect(after).toBe(state);
    state = reduce(state, { type: 'error', seq: 1, kernelId: null, message: 'late' });
    expect(state.phase).toBe('ok');
  });

  it('keeps the last good status through an error', () => {
    let state = reduce(withCurrent(null), { type: 'status', seq: 1, kernelId: null, status });
    state = reduce(state, { type: 'error', seq: 2, kernelId: null, message: 'timeout' });
    expect(state).toMatchObject({ phase: 'error', error: 'timeout' });
    expect(state.status).toBe(status);
    state = reduce(state, { type: 'status', seq: 3, kernelId: null, status });
    expect(state).toMatchObject({ phase: 'ok', error: null });
  });

  it('knows a server without the extension, and one without a GPU', () => {
    const missing = reduce(withCurrent(null), { type: 'missing', seq: 1, kernelId: null });
    expect(missing).toMatchObject({ phase: 'missing', status: null });
    const noGpu = reduce(withCurrent(null), {
      type: 'status',
      seq: 1,
      kernelId: null,
      status: normalizeStatus({ gpu: false, message: 'no GPU: NVML library not found' })
    });
    expect(noGpu.phase).toBe('no-gpu');
  });

  it('removes a shut-down kernel at once', () => {
    let state = reduce(withCurrent(null), { type: 'status', seq: 1, kernelId: null, status });
    state = reduce(state, { type: 'removed', kernelId: 'k1' });
    expect(state.status!.kernels).toEqual([]);
    expect(reduce(state, { type: 'removed', kernelId: 'k1' })).toBe(state);
  });

  it('returns the same state when nothing changes', () => {
    const state = withCurrent('k1');
    expect(reduce(state, { type: 'current', kernelId: 'k1' })).toBe(state);
  });
});

describe('statusBarInfo', () => {
  const base = (kernels: IKernelStatus[], current: string | null): IState => ({
    ...INITIAL_STATE,
    phase: 'ok',
    currentKernelId: current,
    status: normalizeStatus({ gpu: true, devices: [], kernels })
  });

  it('shows the current kernel against its cap', () => {
    const k = kernel('k1', 'a.ipynb', {
      devices: [{ index: 0, cap: 10 * GiB, used: 3.2 * GiB, reserved: 2 * GiB }]
    });
    const info = statusBarInfo(base([k], 'k1'))!;
    expect(info.text).toBe('GPU 3.2 / 10 GiB');
    expect(info.level).toBe('ok');
    expect(info.usage!.source).toBe('nvml');
  });

  it('turns to warning near the cap', () => {
    const k = kernel('k1', 'a.ipynb', { devices: [{ index: 0, cap: 10 * GiB, reserved: 9.5 * GiB }] });
    const info = statusBarInfo(base([k], 'k1'))!;
    expect(info.level).toBe('warning');
    expect(info.usage!.source).toBe('allocator');
    expect(statusBarInfo(base([k], 'k1'), 0.99)!.level).toBe('ok');
  });

  it('shows the device nearest its cap for a kernel on several', () => {
    const k = kernel('k1', 'a.ipynb', {
      devices: [
        { index: 0, cap: 10 * GiB, used: 1 * GiB },
        { index: 1, cap: 20 * GiB, used: 15 * GiB }
      ]
    });
    expect(statusBarInfo(base([k], 'k1'))!.text).toBe('GPU 15 / 20 GiB');
  });

  it('says CPU only for a kernel without a GPU', () => {
    const k = kernel('k1', 'a.ipynb', { devices: [], cpu_only_reason: 'every GPU is full' });
    expect(statusBarInfo(base([k], 'k1'))!.text).toBe('GPU: CPU only');
  });

  it('hides without a current kernel, a grant or the extension', () => {
    const k = kernel('k1', 'a.ipynb');
    expect(statusBarInfo(base([k], null))).toBeNull();
    expect(statusBarInfo(base([k], 'other'))).toBeNull();
    expect(statusBarInfo({ ...base([k], 'k1'), phase: 'missing' })).toBeNull();
    expect(statusBarInfo(INITIAL_STATE)).toBeNull();
  });
});

describe('serverMessage', () => {
  it('shows the message of an error answer as written, a percent sign once', () => {
    const body = {
      message: "cap: '2.5': a fraction of the device must be above 0 and at most 1 (100%)",
      reason: null
    };
    expect(serverMessage(body, 'Bad Request')).toBe(body.message);
    expect(serverMessage({ message: "'25%%' is not a number" }, 'x')).toBe("'25%%' is not a number"); // what was typed
  });

  it('falls back to the reason, then to the status text', () => {
    expect(serverMessage({ message: '', reason: 'GPU budget full' }, 'Service Unavailable')).toBe('GPU budget full');
    expect(serverMessage({ message: null }, 'Bad Request')).toBe('Bad Request');
    expect(serverMessage('not an object', 'Bad Request')).toBe('Bad Request');
    expect(serverMessage(null, 'Forbidden')).toBe('Forbidden');
  });

  it('cuts a long message short', () => {
    const shown = serverMessage({ message: 'cap: ' + 'x'.repeat(1 << 20) }, 'Bad Request');
    expect(shown.length).toBe(MAX_MESSAGE_CHARS);
    expect(shown.endsWith('…')).toBe(true);
    expect(shown.startsWith('cap: xxx')).toBe(true);
  });
});

describe('labelled', () => {
  it('puts the server\'s words after a label, never reading them as a format', () => {
    expect(labelled('Failed', 'kernel %1 uses 25%% of it')).toBe('Failed: kernel %1 uses 25%% of it');
    expect(labelled('Failed', '')).toBe('Failed');
    expect(labelled('Failed', null)).toBe('Failed');
  });

  it('says each thing once when the server\'s words already say the label', () => {
    expect(labelled('No GPU on this server', 'no GPU: NVML could not start (NVMLError_LibraryNotFound)')).toBe(
      'No GPU on this server: NVML could not start (NVMLError_LibraryNotFound)'
    );
    const said = labelled('Clamped', 'clamped to max_cap 40.0 GiB on device 0');
    expect(said).toBe('Clamped to max_cap 40.0 GiB on device 0');
    expect(labelled('Not a cap', "cap: 'lots' is not a cap; use a fraction like 0.25")).toBe(
      "Cap: 'lots' is not a cap; use a fraction like 0.25"
    );
    expect(labelled('Granted', 'cap set to 20.0 GiB on device 0')).toBe('Granted: cap set to 20.0 GiB on device 0');
  });
});

describe('monitorNotice', () => {
  const withMonitor = (monitor: any, gpu = true) => normalizeStatus({ ...TODAY, gpu, monitor });

  it('says when the monitor is stalled, in the server\'s words', () => {
    const message = 'no GPU sample since 2026-11-29 10:00:00 UTC: an NVML call has not returned for 9 s';
    const notice = monitorNotice(withMonitor({ state: 'stalled', message, sampled_at: 1, stalled_after: 3 }));
    expect(notice).toEqual({ problem: 'stalled', message, detail: message, level: 'over' });
  });

  it('flags unreadable GPUs and is quiet when the figures can be trusted', () => {
    expect(monitorNotice(withMonitor({ state: 'error', message: 'no GPU could be read' }))!.level).toBe('over');
    expect(monitorNotice(withMonitor({ state: 'degraded', message: 'GPU 1 unreadable' }))!.level).toBe('warning');
    expect(monitorNotice(withMonitor({ state: 'ok', message: null }))).toBeNull();
    expect(monitorNotice(withMonitor({ state: 'starting' }))).toBeNull();
    expect(monitorNotice(withMonitor({ state: 'stalled' }, false))).toBeNull(); // no GPU: nothing to monitor
    expect(monitorNotice(normalizeStatus(TODAY))).toBeNull(); // an older server: no monitor field
    expect(monitorNotice(withMonitor('junk'))).toBeNull();
    expect(monitorNotice(null)).toBeNull();
  });

  it('cuts a long monitor message short', () => {
    const notice = monitorNotice(withMonitor({ state: 'stalled', message: 'y'.repeat(10_000) }))!;
    expect(notice.message.length).toBe(MAX_MESSAGE_CHARS);
  });
});
