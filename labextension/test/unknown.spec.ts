/**
 * Unknown usage is shown as unknown, never as 0: the figure, the bar, the status bar, and the banner that
 * says why; and each row's one line says one short reason, its raw detail kept for the tooltip.
 */
import { IKernelStatus, normalizeStatus } from '../src/contract';
import {
  barFraction,
  kernelDeviceUsage,
  kernelLine,
  monitorNotice,
  statusBarInfo,
  usageLevel,
  usagePair
} from '../src/derive';
import { reasonText } from '../src/format';
import { INITIAL_STATE, IState } from '../src/state';

const GiB = 1024 ** 3;
const RAW_DLOPEN =
  'no checkpoint driver: no CUDA driver here (libcuda.so.1 cannot be loaded: libcuda.so.1: cannot open ' +
  'shared object file: No such file or directory)';
const NO_DRIVER = 'no NVIDIA driver is loaded on this machine';

function kernel(extra: Partial<IKernelStatus> = {}): IKernelStatus {
  return { id: 'k1', path: 'a.ipynb', kernelspec: 'python3', devices: [{ index: 0, cap: 20 * GiB }], ...extra };
}

function state(kernels: any[], monitor: any = { state: 'ok' }): IState {
  return {
    ...INITIAL_STATE,
    phase: 'ok',
    currentKernelId: 'k1',
    status: normalizeStatus({ gpu: true, devices: [], kernels, monitor })
  };
}

describe('unknown usage', () => {
  it('is "unknown" against the cap, not "0 / 20 GiB"', () => {
    // What the API says when NVML cannot read the device and the kernel reported nothing.
    const usage = kernelDeviceUsage({ index: 0, cap: 20 * GiB, used: null, allocated: null, reserved: null });
    expect(usage.bytes).toBeNull();
    expect(usagePair(usage, 20 * GiB)).toBe('unknown / 20 GiB');
    expect(usagePair({ bytes: 0, source: 'nvml' }, 20 * GiB)).toBe('0 / 20 GiB');
  });

  it('is neither a warning nor a bar of some length', () => {
    expect(usageLevel(null, 20 * GiB)).toBe('ok');
    expect(barFraction(null, 20 * GiB)).toBe(0);
  });

  it('shows in the status bar as unknown', () => {
    const info = statusBarInfo(state([kernel({ devices: [{ index: 0, cap: 20 * GiB, used: null }] })]))!;
    expect(info.text).toBe('GPU unknown / 20 GiB');
    expect(info.usage).toEqual({ bytes: null, source: 'unknown' });
  });

  it('in the status bar, a known device wins over an unknown one', () => {
    const devices = [
      { index: 0, cap: 20 * GiB, used: null },
      { index: 1, cap: 20 * GiB, used: 2 * GiB }
    ];
    expect(statusBarInfo(state([kernel({ devices })]))!.text).toBe('GPU 2 / 20 GiB');
  });

  it('has its reason in the banner: a monitor that cannot measure says so, plainly', () => {
    const monitor = { state: 'no-gpu', message: 'no GPU usage: NVML could not start (NVMLError_LibraryNotFound: x)' };
    const status = normalizeStatus({
      gpu: true,
      devices: [],
      kernels: [],
      monitor,
      reasons: { no_gpu: null, monitor: { reason: NO_DRIVER, detail: monitor.message } }
    });
    expect(monitorNotice(status)).toEqual({
      problem: 'unmeasured',
      message: NO_DRIVER,
      detail: monitor.message,
      level: 'ok'
    });
  });
});

describe('one short reason per row', () => {
  it('says why a kernel cannot park in the server\'s few words, the dlopen text kept for the tooltip', () => {
    const line = kernelLine(
      kernel({
        park: { state: 'idle', parkable: false, reason: RAW_DLOPEN },
        reasons: { park: { reason: NO_DRIVER, detail: RAW_DLOPEN }, cpu_only: null, hard_limit: null }
      })
    )!;
    expect(line).toMatchObject({ kind: 'not-parkable', words: NO_DRIVER, detail: RAW_DLOPEN });
  });

  it('falls back to the raw reason from a server that sends no pairs', () => {
    const line = kernelLine(kernel({ park: { state: 'idle', parkable: false, reason: 'MPS client' } }))!;
    expect(line).toMatchObject({ kind: 'not-parkable', words: 'MPS client', detail: 'MPS client' });
  });

  it('says the park state of a parkable kernel, a waiting one as a warning with what it waits for', () => {
    expect(kernelLine(kernel({ park: { state: 'idle', parkable: true, idle_seconds: 720 } }))).toMatchObject({
      kind: 'park',
      words: 'idle for 12 min',
      level: 'ok'
    });
    const raw = 'waiting for device memory others hold now: it needs 2 GiB on GPU 0; retry 1 in 5 s (nothing is lost)';
    const waiting = kernelLine(
      kernel({
        park: { state: 'waiting', parkable: true, reason: raw },
        reasons: {
          park: { reason: 'waiting for device memory others hold now: it needs 2 GiB on GPU 0', detail: raw },
          cpu_only: null,
          hard_limit: null
        }
      })
    )!;
    expect(waiting.words).toBe('waiting for device memory others hold now: it needs 2 GiB on GPU 0');
    expect(waiting.level).toBe('warning');
  });

  it('says why a kernel has no GPU, and nothing for a kernel of a server that does not park', () => {
    const full = 'no GPU has 0.25 of budget left for kernelspec \'python3\' (overcommit 1.0)';
    const cpu = kernelLine(
      kernel({
        devices: [],
        cpu_only_reason: full,
        reasons: {
          cpu_only: { reason: 'no GPU has 0.25 of budget left for kernelspec \'python3\'', detail: full },
          park: null,
          hard_limit: null
        }
      })
    )!;
    expect(cpu).toMatchObject({ kind: 'cpu-only', words: 'no GPU has 0.25 of budget left for kernelspec \'python3\'' });
    expect(kernelLine(kernel())).toBeNull();
  });

  it('reasonText takes the pair made for this text, the raw text otherwise, nothing for nothing', () => {
    const pair = { reason: 'few words', detail: 'the raw   text' };
    expect(reasonText(pair, 'the raw text')).toEqual({ words: 'few words', detail: 'the raw text' });
    expect(reasonText(pair, null)).toEqual({ words: 'few words', detail: 'the raw text' });
    // A reason newer than the pair (a park answer's, which has no pairs): its own words.
    expect(reasonText(pair, 'another reason')).toEqual({ words: 'another reason', detail: 'another reason' });
    expect(reasonText(null, '  raw  ')).toEqual({ words: 'raw', detail: 'raw' });
    expect(reasonText(null, null)).toBeNull();
  });
});

describe('normalizeStatus and reasons', () => {
  it('keeps only well-formed pairs', () => {
    const status = normalizeStatus({
      gpu: false,
      message: 'no GPU: raw',
      reasons: { no_gpu: { reason: 'few', detail: 'no GPU: raw' }, monitor: 'junk' },
      kernels: [{ id: 'k', devices: [], reasons: { park: { detail: 'no words' } } }]
    });
    expect(status.reasons).toEqual({ no_gpu: { reason: 'few', detail: 'no GPU: raw' }, monitor: null });
    expect(status.kernels[0].reasons).toEqual({ cpu_only: null, park: null, hard_limit: null });
    expect(normalizeStatus({}).reasons).toEqual({ no_gpu: null, monitor: null });
  });
});
