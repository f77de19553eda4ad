/**
 * Parking in the sidebar: the park state in words, which of Park / Resume a kernel row offers, what
 * it says after an answer, and the requests the buttons send (the contract's routes, POST, through
 * ServerConnection so the server's auth and XSRF header go with them).
 */
import { ServerConnection } from '@jupyterlab/services';

import { requestPark } from '../src/api';
import { IKernelPark, IKernelStatus, normalizeStatus, PARK_STATES } from '../src/contract';
import { kernelLine, PARK_TITLE, parkButtons, parkFeedback, RESUME_TITLE } from '../src/derive';
import { lostWords, notParkableText, parkWords, refusalText } from '../src/format';

const GiB = 1024 ** 3;

function park(state: IKernelPark['state'], extra: Partial<IKernelPark> = {}): IKernelPark {
  return { state, since: null, idle_seconds: null, host_bytes: null, parkable: true, reason: null, ...extra };
}

describe('parkWords', () => {
  it('says each state as a person reads it', () => {
    const since = new Date(2026, 10, 29, 14, 2, 0).getTime() / 1000; // local time, as the sidebar shows it
    expect(parkWords(park('busy'))).toBe('running');
    expect(parkWords(park('idle', { idle_seconds: 12 * 60 + 5 }))).toBe('idle for 12 min');
    expect(parkWords(park('idle', { idle_seconds: 7500 }))).toBe('idle for 2 h 5 min');
    // A wait and its limit are said exactly: 100 s of a 100 s limit never reads "1 min (limit 1 min)".
    expect(parkWords(park('waiting', { waited: 100, wait_limit: 100 }))).toBe(
      'waiting for device memory for 1 min 40 s (limit 1 min 40 s)'
    );
    expect(parkWords(park('parked', { since, host_bytes: Math.round(17.8 * GiB) }))).toBe(
      'parked since 14:02, 17.8 GiB on host'
    );
    const fast = { path: 'pages' as const, reason: 'torch', stays_on_device: 612 * 2 ** 20 };
    expect(parkWords(park('parked', { since, host_bytes: 20 * GiB, path: fast }))).toBe(
      'parked since 14:02, 20 GiB on host (fast park: 612 MiB stays on the GPU)'
    );
    const slow = { path: 'checkpoint' as const, reason: 'no torch', stays_on_device: 0 };
    expect(parkWords(park('parked', { since, host_bytes: 20 * GiB, path: slow }))).toBe(
      'parked since 14:02, 20 GiB on host'
    );
    expect(parkWords(park('resuming'))).toBe('resuming');
    expect(parkWords(park('waiting', { reason: 'GPU 0 has 2 GiB free, 17.8 GiB needed' }))).toBe(
      'waiting for device memory: GPU 0 has 2 GiB free, 17.8 GiB needed'
    );
    expect(parkWords(park('pending'))).toBe('parks when its current cell ends');
  });

  it('has its own words for every state of the contract', () => {
    const words = PARK_STATES.map(state => parkWords(park(state)));
    expect(new Set(words).size).toBe(PARK_STATES.length);
    expect(words).not.toContain('unknown');
    expect(words).not.toContain('');
  });
});

describe('parkButtons', () => {
  it('offers Park when parkable and not parked', () => {
    for (const state of ['busy', 'idle'] as const) {
      const buttons = parkButtons(park(state));
      expect(buttons.park).toEqual({ visible: true, enabled: true, title: PARK_TITLE });
      expect(buttons.resume.visible).toBe(false);
    }
  });

  it('offers Resume when parked, disabled while it waits for room (asking again brings nothing sooner)', () => {
    const parked = parkButtons(park('parked'));
    expect(parked.resume).toEqual({ visible: true, enabled: true, title: RESUME_TITLE });
    expect(parked.park.visible).toBe(false);
    const waiting = parkButtons(park('waiting'));
    expect(waiting.resume).toMatchObject({ visible: true, enabled: false });
    expect(waiting.park.visible).toBe(false);
  });

  it('disables Park with the reason as its tooltip when the kernel cannot be parked', () => {
    const reason = 'not parkable: this kernel is an MPS client (the driver answers 801)';
    const buttons = parkButtons(park('busy', { parkable: false, reason }));
    expect(buttons.park).toEqual({ visible: true, enabled: false, title: reason });
    expect(buttons.resume.visible).toBe(false);
  });

  it('disables the button that would race what the server is doing', () => {
    expect(parkButtons(park('pending')).park).toMatchObject({ visible: true, enabled: false });
    expect(parkButtons(park('parking')).park).toMatchObject({ visible: true, enabled: false });
    expect(parkButtons(park('resuming')).resume).toMatchObject({ visible: true, enabled: false });
  });

  it('shows neither on a server that does not park', () => {
    expect(parkButtons(null)).toEqual({
      park: { visible: false, enabled: false, title: '' },
      resume: { visible: false, enabled: false, title: '' }
    });
    expect(normalizeStatus({ gpu: true, kernels: [{ id: 'k', devices: [] }] }).kernels[0].park).toBeNull();
    const status = normalizeStatus({ gpu: true, kernels: [{ id: 'k', devices: [], park: { state: 7 } }] });
    expect(status.kernels[0].park).toBeNull();
  });
});

describe('parkFeedback and refusalText', () => {
  it('says a refusal as written, once', () => {
    expect(refusalText('not parkable: MPS client', 'park')).toBe('Not parkable: MPS client');
    expect(refusalText('the host has 3 GiB free', 'park')).toBe('Cannot park: the host has 3 GiB free');
    expect(refusalText('', 'resume')).toBe('Cannot resume');
    expect(parkFeedback('park', 'refused', 'not parkable: another user (bob)', null)).toEqual({
      text: 'Not parkable: another user (bob)',
      level: 'over'
    });
    expect(
      parkFeedback('park', 'accepted', '', park('busy', { parkable: false, reason: 'not parkable: no GPU' }))
    ).toEqual({ text: 'Not parkable: no GPU', level: 'over' });
  });

  it('says "not parkable" once in the row', () => {
    expect(notParkableText('not parkable: MPS client')).toBe('Not parkable: MPS client');
    expect(notParkableText('MPS client')).toBe('Not parkable: MPS client');
    expect(notParkableText(null)).toBe('Not parkable');
  });

  it('says what the server will do', () => {
    expect(parkFeedback('park', 'accepted', '', park('pending'))).toEqual({
      text: 'Parks when its current cell ends',
      level: 'ok'
    });
    expect(parkFeedback('resume', 'accepted', '', park('resuming')).text).toBe('Resuming');
  });
});

describe('requestPark', () => {
  const settings = ServerConnection.makeSettings({ baseUrl: 'http://localhost:8888/lab-base/' });
  let sent: { url: string; init: RequestInit }[] = [];
  let answer: () => Response;

  beforeEach(() => {
    sent = [];
    jest.spyOn(ServerConnection, 'makeRequest').mockImplementation(async (url, init, given) => {
      expect(given).toBe(settings); // the server's settings: its token and XSRF cookie go along
      sent.push({ url, init });
      return answer();
    });
  });

  afterEach(() => jest.restoreAllMocks());

  const json = (status: number, body: unknown) =>
    ({ status, ok: status >= 200 && status < 300, statusText: '', json: async () => body }) as unknown as Response;

  it('POSTs the contract routes and reads a 202', async () => {
    answer = () => json(202, { park: park('pending') });
    const parked = await requestPark(settings, 'k/1', 'park');
    expect(sent[0].url).toBe('http://localhost:8888/lab-base/api/gpu-quota/kernels/k%2F1/park');
    expect(sent[0].init.method).toBe('POST');
    expect(parked).toEqual({ outcome: 'accepted', message: '', park: park('pending') });
    answer = () => json(202, { park: park('resuming') });
    await requestPark(settings, 'k1', 'resume');
    expect(sent[1].url).toBe('http://localhost:8888/lab-base/api/gpu-quota/kernels/k1/resume');
  });

  it('reads a refusal as an answer, and throws one line on anything else', async () => {
    answer = () => json(409, { message: 'not parkable: MPS client' });
    expect(await requestPark(settings, 'k1', 'park')).toEqual({
      outcome: 'refused',
      message: 'not parkable: MPS client',
      park: null
    });
    answer = () => json(404, { message: 'Not Found' });
    await expect(requestPark(settings, 'k1', 'park')).rejects.toThrow(
      'this server cannot park kernels: it has no park route (HTTP 404)'
    );
    answer = () => json(403, { message: 'not authorized to write GPU quotas' });
    await expect(requestPark(settings, 'k1', 'resume')).rejects.toMatchObject({
      status: 403,
      message: 'not authorized to write GPU quotas'
    });
  });
});

describe('a kernel lost while parked', () => {
  const at = new Date(2026, 11, 4, 1, 23, 0).getTime() / 1000; // local time, as the sidebar shows it
  const why = "its process ended while parked (killed by SIGKILL: the host's out-of-memory killer, or a kill -9?)";
  const words = `gpu-quota: this kernel was restarted at 01:23 because ${why}; its variables and GPU memory are gone.`;

  function restarted(lost: IKernelPark['lost']): IKernelStatus {
    return normalizeStatus({
      gpu: true,
      kernels: [{ id: 'k1', devices: [{ index: 0, cap: 20 * GiB }], park: park('idle', { idle_seconds: 3, lost }) }]
    }).kernels[0];
  }

  it('says when, why and what is gone, in the error colour, until its next cell has said it', () => {
    expect(lostWords({ at, why, words })).toBe(
      `restarted at 01:23: ${why}; its variables and GPU memory are gone: run the notebook's cells again`
    );
    expect(kernelLine(restarted({ at, why, words }))).toEqual({
      kind: 'park',
      words: lostWords({ at, why, words }),
      detail: words,
      level: 'over',
      state: 'lost'
    });
  });

  it('goes back to the park state once the server drops the news', () => {
    expect(kernelLine(restarted(null))).toMatchObject({ kind: 'park', words: 'idle for 3 s', level: 'ok' });
    expect(lostWords(undefined)).toBe('');
  });
});
