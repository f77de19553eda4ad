/**
 * What the sidebar asks of the server and of JupyterLab. index.ts gives these to the panel, which hands
 * them to every kernel row: the rows stay plain DOM, testable without a server or a shell to open files in.
 */

import { ICapResult, IParkResult } from './api';
import { IKernelStatus } from './contract';

export interface IPanelActions {
  setCap(
    kernelId: string,
    request: { cap: string } | { reset: true }
  ): Promise<ICapResult>;
  /** POST kernels/<id>/park or /resume (shared/contract.py: PARK_SUFFIX, RESUME_SUFFIX). */
  park(kernelId: string, action: 'park' | 'resume'): Promise<IParkResult>;
  /** Resolves true when the kernel was shut down (false: the user cancelled). */
  shutdown(kernel: IKernelStatus): Promise<boolean>;
  open(path: string): void;
}
