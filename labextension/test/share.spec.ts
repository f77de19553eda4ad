import { normalizeStatus } from '../src/contract';
import { canReuseShared } from '../src/share';

describe('canReuseShared', () => {
  const shared = { time: 10_000, status: normalizeStatus({ gpu: true, kernels: [] }) };

  it('reuses what another tab fetched less than half an interval ago', () => {
    expect(canReuseShared(shared, 10_999, 2000, false)).toBe(true);
    expect(canReuseShared(shared, 11_000, 2000, false)).toBe(false);
    expect(canReuseShared(shared, 9_000, 2000, false)).toBe(false); // from the future: clock skew
  });

  it('asks the server when told to, or when nothing was shared', () => {
    expect(canReuseShared(shared, 10_001, 2000, true)).toBe(false);
    expect(canReuseShared(null, 10_001, 2000, false)).toBe(false);
  });
});
