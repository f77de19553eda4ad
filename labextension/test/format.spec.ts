import { formatAge, formatBytes, formatPair, formatPercent, toMillis } from '../src/format';

const GiB = 1024 ** 3;
const MiB = 1024 ** 2;

describe('formatBytes', () => {
  it.each([
    [0, '0 B'],
    [512, '512 B'],
    [1024, '1 KiB'],
    [512 * MiB, '512 MiB'],
    [3.2 * GiB, '3.2 GiB'],
    [10 * GiB, '10 GiB'],
    [80 * GiB, '80 GiB'],
    [1.5 * 1024 * GiB, '1.5 TiB']
  ])('%d bytes reads "%s"', (bytes, text) => {
    expect(formatBytes(bytes)).toBe(text);
  });

  it('says nothing it does not know', () => {
    expect(formatBytes(null)).toBe('–');
    expect(formatBytes(undefined)).toBe('–');
    expect(formatBytes(NaN)).toBe('–');
  });
});

describe('formatPair', () => {
  it('puts both figures in the unit of the larger', () => {
    expect(formatPair(3.2 * GiB, 10 * GiB)).toBe('3.2 / 10 GiB');
    expect(formatPair(512 * MiB, 20 * GiB)).toBe('0.5 / 20 GiB');
    expect(formatPair(0, 24 * GiB)).toBe('0 / 24 GiB');
    expect(formatPair(12 * GiB, 10 * GiB)).toBe('12 / 10 GiB');
  });

  it('does not round a small usage to zero', () => {
    expect(formatPair(1 * MiB, 80 * GiB)).toBe('<0.1 / 80 GiB');
  });
});

describe('formatPercent', () => {
  it('rounds', () => {
    expect(formatPercent(0.304)).toBe('30%');
    expect(formatPercent(null)).toBe('–');
  });
});

describe('ages', () => {
  const now = Date.parse('2026-11-29T12:00:00Z');
  it('reads epoch seconds, milliseconds and ISO strings', () => {
    expect(toMillis(now / 1000)).toBe(now);
    expect(toMillis(now)).toBe(now);
    expect(toMillis('2026-11-29T12:00:00Z')).toBe(now);
    expect(toMillis('not a time')).toBeNull();
    expect(toMillis(null)).toBeNull();
  });

  it.each([
    [0, 'just now'],
    [12, '12 s ago'],
    [180, '3 min ago'],
    [7200, '2 h ago'],
    [4 * 86400, '4 d ago']
  ])('%d s earlier reads "%s"', (seconds, text) => {
    expect(formatAge(now / 1000 - seconds, now)).toBe(text);
  });

  it('gives nothing for an unreadable time', () => {
    expect(formatAge(undefined, now)).toBe('');
  });
});
