/**
 * The server's GPU quota API, through ServerConnection (base URL, token and xsrf header handled).
 */

import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';

import { IKernelStatus, IQuotaStatus, normalizeStatus, serverMessage, shorten } from './state';

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

export async function fetchStatus(
  settings: ServerConnection.ISettings
): Promise<IQuotaStatus> {
  const url = URLExt.join(settings.baseUrl, 'api/gpu-quota/status');
  const response = await ServerConnection.makeRequest(url, {}, settings);
  if (response.status === 404) {
    throw new MissingExtensionError();
  }
  if (!response.ok) {
    throw new ApiError(await readMessage(response), response.status);
  }
  return normalizeStatus(await response.json());
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
