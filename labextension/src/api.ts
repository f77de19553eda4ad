/**
 * The server's GPU quota API, through ServerConnection (base URL, token and xsrf header handled).
 */

import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';

import {
  HISTORY_SINCE,
  HISTORY_SUFFIX,
  IHistoryAnswer,
  IKernelPark,
  IKernelStatus,
  IQuotaStatus,
  normalizeHistory,
  normalizeStatus,
  PARK_SUFFIX,
  RESUME_SUFFIX
} from './contract';
import { serverMessage, shorten } from './format';

/** The status route answered 404: the server extension is not installed or not enabled. */
export class MissingExtensionError extends Error {
  constructor() {
    super('the gpu-quota-ext server extension is not enabled on this server');
    this.name = 'MissingExtensionError';
  }
}

export class ApiError extends Error {
  constructor(
    message: string,
    readonly status: number
  ) {
    super(message);
    this.name = 'ApiError';
  }
}

async function readMessage(response: Response): Promise<string> {
  const fallback = response.statusText || `HTTP ${response.status}`;
  try {
    return serverMessage(await response.json(), fallback);
  } catch {
    return fallback;
  }
}

/** GET a route of the extension's: its JSON, MissingExtensionError on a 404, ApiError on any other failure. */
async function getJson(settings: ServerConnection.ISettings, url: string): Promise<unknown> {
  const response = await ServerConnection.makeRequest(url, {}, settings);
  if (response.status === 404) {
    throw new MissingExtensionError();
  }
  if (!response.ok) {
    throw new ApiError(await readMessage(response), response.status);
  }
  return response.json();
}

export async function fetchStatus(
  settings: ServerConnection.ISettings
): Promise<IQuotaStatus> {
  return normalizeStatus(await getJson(settings, URLExt.join(settings.baseUrl, 'api/gpu-quota/status')));
}

/**
 * GET history: every kernel's usage points after `since` (the server's clock; all kept points when null).
 * A server without the route (an older one) answers 404: MissingExtensionError, and the sidebar stops asking.
 */
export async function fetchHistory(
  settings: ServerConnection.ISettings,
  since: number | null
): Promise<IHistoryAnswer> {
  let url = URLExt.join(settings.baseUrl, 'api/gpu-quota', HISTORY_SUFFIX);
  if (since !== null) {
    url += URLExt.objectToQueryString({ [HISTORY_SINCE]: String(since) });
  }
  return normalizeHistory(await getJson(settings, url));
}

export interface ICapResult {
  /** "granted", "clamped" or "refused" (HTTP 409); "invalid" for a 400 (the message says why). */
  outcome: 'granted' | 'clamped' | 'refused' | 'invalid';
  message: string;
  kernel: IKernelStatus | null;
}

/**
 * Ask for a new cap ("0.3", "30%", "12GiB" or bytes) on one device (or every granted device), or
 * reset to what policy gives. The server applies the same limits as %gpucap.
 */
export async function requestCap(
  settings: ServerConnection.ISettings,
  kernelId: string,
  request: { cap: string | number; device?: number } | { reset: true }
): Promise<ICapResult> {
  const url = URLExt.join(
    settings.baseUrl,
    'api/gpu-quota/kernels',
    encodeURIComponent(kernelId)
  );
  const response = await ServerConnection.makeRequest(
    url,
    { method: 'PUT', body: JSON.stringify(request) },
    settings
  );
  if (response.status === 400) {
    return { outcome: 'invalid', message: await readMessage(response), kernel: null };
  }
  if (response.status === 200 || response.status === 409) {
    const body = await response.json();
    return {
      outcome: body.outcome,
      message: typeof body.message === 'string' ? shorten(body.message) : '',
      kernel: body.kernel || null
    };
  }
  throw new ApiError(await readMessage(response), response.status);
}

export interface IParkResult {
  /** "accepted" (202: `park` is the kernel's park state now) or "refused" (the message says why). */
  outcome: 'accepted' | 'refused';
  message: string;
  park: IKernelPark | null;
}

/**
 * POST kernels/<id>/park (park once its current cell has finished) or /resume (bring it back now),
 * with the server's auth and XSRF header like every request of the sidebar. A refusal (400, 409: not
 * parkable, host memory short) is an answer; anything else that is not a 2xx throws an ApiError.
 */
export async function requestPark(
  settings: ServerConnection.ISettings,
  kernelId: string,
  action: 'park' | 'resume'
): Promise<IParkResult> {
  const url = URLExt.join(
    settings.baseUrl,
    'api/gpu-quota/kernels',
    encodeURIComponent(kernelId),
    action === 'park' ? PARK_SUFFIX : RESUME_SUFFIX
  );
  const response = await ServerConnection.makeRequest(url, { method: 'POST', body: '{}' }, settings);
  if (response.status === 400 || response.status === 409) {
    return { outcome: 'refused', message: await readMessage(response), park: null };
  }
  if (response.ok) {
    let body: any = null;
    try {
      body = await response.json();
    } catch {
      body = null;
    }
    const park = body && body.park && typeof body.park.state === 'string' ? body.park : null;
    return {
      outcome: 'accepted',
      message: body && typeof body.message === 'string' ? shorten(body.message) : '',
      park
    };
  }
  if (response.status === 404) {
    let message = '';
    try {
      message = serverMessage(await response.json(), '');
    } catch {
      message = '';
    }
    if (!message || message.toLowerCase() === 'not found') {
      message = `this server cannot park kernels: it has no ${action} route (HTTP 404)`;
    }
    throw new ApiError(message, 404);
  }
  throw new ApiError(await readMessage(response), response.status);
}
