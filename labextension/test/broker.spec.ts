/**
 * The broker in the sidebar: a kernel waiting for device memory (how long, the limit, what for), one whose
 * wait passed the limit (told), and a lost one (its restore failed): their words, the level of their line,
 * and which buttons their row offers (their chart's bands: history.spec.ts). The words are the notebook's
 * (gpu_quota_ext/kernel/park.py, state_words): the last test asks Python for them.
 */
import { spawnSync } from 'child_process';
import * as path from 'path';

import { IKernelPark, IKernelStatus, normalizeStatus } from '../src/contract';
import { kernelLine, offersCap, parkButtons, parkFeedback, RESUME_TITLE, WAITING_TITLE } from '../src/derive';
import { LOST_WORDS, parkWords } from '../src/format';

const GiB = 1024 ** 3;

// The server's own words (gpu_quota_ext/parking/broker.py, wording.py; shared/reasons.py's short pairs).
const MAKING_ROOM = 'needs 56.8 GiB on GPU 0; making room: idle kernel kernel 9d993c7f parking';
const MAKING_ROOM_WORDS = 'needs 56.8 GiB on GPU 0';
const TOLD = `waited 300 s (the park_wait_limit) for device memory: ${MAKING_ROOM}`;
const TOLD_WORDS = 'waited 300 s for device memory: needs 56.8 GiB on GPU 0';
const LOST =
  'its GPU memory (17.0 GiB) could not be brought back: cuCheckpointProcessRestore(pid 4242) failed: ' +
  'CUDA_ERROR_OUT_OF_MEMORY (2). The driver cannot restore it again: what was on the GPU is lost. Variables in ' +
  'host memory are still there: save what you need (no GPU call will return), then restart the kernel; that ' +
  'frees its host memory';
const LOST_PAIR = 'its GPU memory could not be brought back: save what is in host memory, then restart the kernel';

function park(state: IKernelPark['state'], extra: Partial<IKernelPark> = {}): IKernelPark {
  return {
    state,
    since: null,
    idle_seconds: null,
    host_bytes: null,
    parkable: true,
    reason: null,
    waited: null,
    wait_limit: 300,
    told: false,
    ...extra
  };
}

/** A kernel as the server's status answer has it: its park object and the short pair of its reason. */
function kernel(p: IKernelPark, words: string | null = null): IKernelStatus {
  return normalizeStatus({
    gpu: true,
    kernels: [
      {
        id: 'k1',
        devices: [{ index: 0, cap: 20 * GiB }],
        park: p,
        reasons: { park: words && p.reason ? { reason: words, detail: p.reason } : null }
      }
    ]
  }).kernels[0];
}

describe('a kernel waiting for device memory', () => {
  it('says how long it has waited, the limit, and what for', () => {
    const waiting = park('waiting', { reason: MAKING_ROOM, waited: 12.4 });
    expect(parkWords(waiting)).toBe(`waiting for device memory for 12 s (limit 5 min): ${MAKING_ROOM}`);
    expect(parkWords({ ...waiting, waited: 75, wait_limit: 600 })).toBe(
      `waiting for device memory for 1 min 15 s (limit 10 min): ${MAKING_ROOM}`
    );
  });

  it('leaves out what it does not know: no time before a second has passed, no limit when there is none', () => {
    const first = park('waiting', { reason: 'asking for device memory to come back to', waited: 0.3 });
    expect(parkWords(first)).toBe('waiting for device memory (limit 5 min): asking for device memory to come back to');
    expect(parkWords({ ...first, waited: 12, wait_limit: null })).toBe(
      'waiting for device memory for 12 s: asking for device memory to come back to'
    );
    expect(parkWords(park('waiting', { wait_limit: null }))).toBe('waiting for device memory');
    // An older server: no waited, no limit, and a reason that already says it waits.
    const old = 'waiting for device memory others hold now: it needs 2 GiB on GPU 0';
    expect(parkWords(park('waiting', { reason: old, wait_limit: undefined }))).toBe(old);
  });

  it('is a warning line in the server\'s few words, the whole reason on hover', () => {
    const line = kernelLine(kernel(park('waiting', { reason: MAKING_ROOM, waited: 12 }), MAKING_ROOM_WORDS))!;
    expect(line).toEqual({
      kind: 'park',
      words: `waiting for device memory for 12 s (limit 5 min): ${MAKING_ROOM_WORDS}`,
      detail: MAKING_ROOM,
      level: 'warning',
      state: 'waiting'
    });
  });

  it('shows Resume disabled, saying it comes back as soon as there is room; Park hidden', () => {
    const buttons = parkButtons(park('waiting', { reason: MAKING_ROOM, waited: 12 }));
    expect(buttons.resume).toEqual({ visible: true, enabled: false, title: WAITING_TITLE });
    expect(buttons.park.visible).toBe(false);
    expect(WAITING_TITLE).toMatch(/as soon as there is room/);
    // A parked kernel still offers Resume: asking is what makes it wait for room.
    expect(parkButtons(park('parked')).resume).toEqual({ visible: true, enabled: true, title: RESUME_TITLE });
  });

  it('is what a Resume answer says too', () => {
    const answer = park('waiting', { reason: 'asking for device memory to come back to', waited: 0 });
    expect(parkFeedback('resume', 'accepted', '', answer)).toEqual({
      text: 'Waiting for device memory (limit 5 min): asking for device memory to come back to',
      level: 'ok'
    });
  });
});

describe('a kernel whose wait passed the limit (told)', () => {
  const told = park('waiting', { reason: TOLD, waited: 301, told: true });

  it('says the cell did not run and the kernel stays parked, what it waited for on hover', () => {
    expect(parkWords(told)).toBe(
      'waited past its limit (5 min): the cell did not run; the kernel stays parked with its grant'
    );
    const line = kernelLine(kernel(told, TOLD_WORDS))!;
    expect(line).toMatchObject({ kind: 'park', level: 'warning', state: 'waiting', detail: TOLD });
    expect(line.words).toBe(parkWords(told));
  });

  it('offers nothing that would change it: Resume disabled until the cell has ended and it is parked', () => {
    expect(parkButtons(told).resume).toMatchObject({ visible: true, enabled: false });
    expect(parkButtons(told).park.visible).toBe(false);
  });

  it('says the limit it passed only when it knows it', () => {
    expect(parkWords({ ...told, wait_limit: null })).toBe(
      'waited past its limit: the cell did not run; the kernel stays parked with its grant'
    );
  });
});

describe('a lost kernel (its restore failed)', () => {
  // The server says parkable: false for it (parking cannot work for it any more).
  const lost = park('lost', { reason: LOST, parkable: false });

  it('is an error line saying what is lost and what the user can still do, not "not parkable"', () => {
    const line = kernelLine(kernel(lost, LOST_PAIR))!;
    expect(line).toEqual({ kind: 'park', words: `lost: ${LOST_PAIR}`, detail: LOST, level: 'over', state: 'lost' });
    expect(line.words).toMatch(/save what is in host memory, then restart the kernel$/);
  });

  it('falls back to the raw reason, and to the notebook\'s words when the server gives none', () => {
    expect(kernelLine(kernel(lost))!.words).toBe(`lost: ${LOST.slice(0, 299)}…`);
    expect(parkWords(park('lost'))).toBe(`lost: ${LOST_WORDS}`);
    expect(kernelLine(kernel(park('lost', { parkable: false })))).toMatchObject({
      words: 'lost: its GPU memory could not be brought back; restart the kernel',
      level: 'over'
    });
  });

  it('offers neither Park nor Resume (only Shut down, which the row always has)', () => {
    expect(parkButtons(lost)).toEqual({
      park: { visible: false, enabled: false, title: '' },
      resume: { visible: false, enabled: false, title: '' }
    });
    expect(parkButtons({ ...lost, parkable: true }).resume.visible).toBe(false);
  });

  it('offers no cap either: only a restart or a shutdown helps it', () => {
    expect(offersCap(kernel(lost, LOST_PAIR))).toBe(false);
    expect(offersCap(kernel(park('waiting', { reason: MAKING_ROOM })))).toBe(true);
    expect(offersCap(kernel(park('parked')))).toBe(true);
    expect(offersCap({ ...kernel(park('idle')), devices: [] })).toBe(false); // no GPU: nothing to cap
  });

  it('a refused Resume says why, as the server wrote it', () => {
    expect(parkFeedback('resume', 'refused', LOST, null)).toEqual({
      text: `Cannot resume: ${LOST.slice(0, 299)}…`,
      level: 'over'
    });
  });
});

describe('the same words as the notebook (gpu_quota_ext/kernel/park.py, state_words)', () => {
  const ROOT = path.resolve(__dirname, '..', '..');

  /** park.py's words for each park object, from Python itself. */
  function notebookWords(parks: IKernelPark[]): string[] {
    const python = process.env.PYTHON || 'python3';
    const script =
      'import json, sys\n' +
      'from gpu_quota_ext.kernel.park import state_words\n' +
      'print(json.dumps([state_words(p) for p in json.load(sys.stdin)]))\n';
    const run = spawnSync(python, ['-c', script], {
      input: JSON.stringify(parks),
      env: { ...process.env, PYTHONPATH: ROOT },
      encoding: 'utf-8'
    });
    expect(run.error).toBeUndefined();
    expect(run.stderr).toBe('');
    return JSON.parse(run.stdout);
  }

  it('says every state as %gpucap does', () => {
    const since = new Date(2026, 10, 29, 14, 2, 0).getTime() / 1000;
    const parks = [
      park('busy'),
      park('idle', { idle_seconds: 7500 }),
      park('pending'),
      park('parking'),
      park('parked', { since, host_bytes: Math.round(17.8 * GiB) }),
      park('resuming'),
      park('waiting', { reason: MAKING_ROOM, waited: 12, wait_limit: null }),
      park('waiting', { reason: MAKING_ROOM, waited: 12 }),
      park('waiting', { reason: MAKING_ROOM, waited: 300, told: true }),
      park('lost', { reason: LOST.slice(0, 200), parkable: false }),
      park('lost', { parkable: false })
    ];
    const sidebar = parks.map(p => parkWords(p));
    const notebook = notebookWords(parks);
    expect(sidebar).toEqual(notebook);
    expect(sidebar[7]).toContain('(limit 5 min)');
  });
});
