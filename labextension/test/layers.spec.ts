import { IKernelLayers } from '../src/contract';
import { layersLine } from '../src/layers';

const GiB = 1024 ** 3;
const MiB = 1024 ** 2;
const trans = {
  __: (msgid: string, ...args: any[]) => msgid.replace(/%(\d)/g, (_, n) => String(args[Number(n) - 1]))
};

const HARD: IKernelLayers = {
  soft: true,
  hard_cap: 'auto',
  hard_limit: { mps: { '0': 40 * GiB + 640 * MiB, '1': 40 * GiB + 640 * MiB } },
  hard_usable: { '0': 40 * GiB, '1': 40 * GiB },
  hard_reason: null,
  restart_needed: false
};

describe('layersLine', () => {
  it('shows the hard limit a kernel can use, once when every device has the same', () => {
    const line = layersLine(HARD, trans)!;
    expect(line.text).toBe('hard limit 40 GiB (MPS)');
    expect(line.hard).toBe(true);
    expect(line.title).toContain('GPU 0 40.6 GiB, GPU 1 40.6 GiB');
    // Whether it can park is the park object's answer (its row line), not the layers'.
    expect(line.title).not.toContain('park');
  });

  it('lists different limits and says when a raise waits for a restart', () => {
    const line = layersLine(
      { ...HARD, hard_usable: { '1': 20 * GiB, '0': 40 * GiB }, restart_needed: true },
      trans
    )!;
    expect(line.text).toBe('hard limit 40 GiB, 20 GiB (MPS); a higher cap applies after a restart');
  });

  it('says why a kernel has soft caps only', () => {
    const line = layersLine(
      { soft: true, hard_cap: 'auto', hard_limit: null, hard_reason: 'the MPS server runs for another Unix user' },
      trans
    )!;
    expect(line).toMatchObject({ text: 'soft cap only: the MPS server runs for another Unix user', hard: false });
  });

  it('shows nothing when hard limits are off, the server is older, or the kernel has no GPU', () => {
    expect(layersLine({ ...HARD, hard_cap: 'off' }, trans)).toBeNull();
    expect(layersLine(undefined, trans)).toBeNull();
    expect(layersLine({ ...HARD, soft: false, hard_limit: null }, trans)).toBeNull();
  });
});
