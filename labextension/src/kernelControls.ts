/**
 * What a kernel row lets the user do, under its figures: a cap field with Set cap and Reset, then Park,
 * Resume and Shut down, in two groups that wrap as wholes rather than overflow a narrow sidebar; and one
 * feedback line with the answer to the last request. Apart from the row because it holds the only state
 * a row has of its own (a request in flight, the park state an answer spoke of); the row shows the kernel.
 */

import { TranslationBundle } from '@jupyterlab/translation';

import { IKernelPark, IKernelStatus } from './contract';
import { IParkButton, offersCap, parkButtons, parkFeedback } from './derive';
import { h, setAttr, setHidden, setLevel, setText } from './dom';
import { labelled } from './format';
import { IPanelActions } from './panelActions';

/** A Park or Resume button as parkButtons() decided: shown or not, enabled or not, its tooltip. */
function setButton(button: HTMLButtonElement, wanted: IParkButton, busy: boolean): void {
  setHidden(button, !wanted.visible);
  const disabled = busy || !wanted.enabled;
  if (button.disabled !== disabled) {
    button.disabled = disabled;
  }
  setAttr(button, 'title', wanted.title);
}

export class KernelControls {
  readonly form = h('form', 'jp-GpuQuota-controls');
  /** The answer to the last request; the row puts it under the form. */
  readonly feedback = h('div', 'jp-GpuQuota-feedback');
  private _capGroup = h('div', 'jp-GpuQuota-capGroup');
  private _capInput = h('input', 'jp-GpuQuota-capInput');
  private _setButton = h('button', 'jp-GpuQuota-button jp-GpuQuota-setCap jp-mod-accept');
  private _resetButton = h('button', 'jp-GpuQuota-button jp-GpuQuota-reset');
  private _parkButton = h('button', 'jp-GpuQuota-button jp-GpuQuota-parkButton');
  private _resumeButton = h('button', 'jp-GpuQuota-button jp-GpuQuota-resumeButton');
  private _shutdownButton = h('button', 'jp-GpuQuota-button jp-GpuQuota-shutdown jp-mod-warn');
  private _parkBusy = false;
  /** The park state a Park / Resume answer spoke of: its feedback goes once the state has moved on. */
  private _feedbackPark: string | null = null;

  /**
   * `kernel`: the kernel as its row last showed it (what Shut down acts on). `parkSettled`: called when a
   * Park or Resume request has ended, with the park state the server answered (none on a refusal without
   * one or a failure), so that the row shows it now rather than at the next poll.
   */
  constructor(
    private _kernelId: string,
    private _trans: TranslationBundle,
    private _actions: IPanelActions,
    private _kernel: () => IKernelStatus | null,
    private _parkSettled: (park: IKernelPark | null) => void
  ) {
    const trans = _trans;
    const kernelGroup = h('div', 'jp-GpuQuota-kernelGroup');
    this._capInput.type = 'text';
    this._capInput.placeholder = trans.__('30%');
    this._capInput.title = trans.__(
      'A fraction of the GPU (0.3), a percentage (30%) or a size (12GiB), within what the admin allows'
    );
    this._capInput.setAttribute('aria-label', trans.__('New cap'));
    this._setButton.type = 'submit';
    this._setButton.textContent = trans.__('Set cap');
    this._resetButton.type = 'button';
    this._resetButton.textContent = trans.__('Reset');
    this._resetButton.title = trans.__('Back to the cap policy gives this kernel');
    this._shutdownButton.type = 'button';
    this._shutdownButton.textContent = trans.__('Shut down');
    this._shutdownButton.title = trans.__('Shut this kernel down');
    this._parkButton.type = 'button';
    this._parkButton.textContent = trans.__('Park');
    this._resumeButton.type = 'button';
    this._resumeButton.textContent = trans.__('Resume');
    this._capGroup.append(this._capInput, this._setButton, this._resetButton);
    kernelGroup.append(this._parkButton, this._resumeButton, this._shutdownButton);
    this.form.append(this._capGroup, kernelGroup);
    this.form.addEventListener('submit', event => {
      event.preventDefault();
      const cap = this._capInput.value.trim();
      if (cap) {
        void this._request({ cap });
      }
    });
    this._resetButton.addEventListener('click', () => void this._request({ reset: true }));
    this._shutdownButton.addEventListener('click', () => void this._shutdown());
    this._parkButton.addEventListener('click', () => void this._parkOrResume('park'));
    this._resumeButton.addEventListener('click', () => void this._parkOrResume('resume'));
    setHidden(this.feedback, true);
    setHidden(this._parkButton, true);
    setHidden(this._resumeButton, true);
  }

  /** The cap's group only for a kernel that can be given a cap (offersCap). */
  update(kernel: IKernelStatus): void {
    setHidden(this._capGroup, !offersCap(kernel));
  }

  /** The Park / Resume buttons as parkButtons() decides, and the end of an answer the state has outlived. */
  updatePark(kernel: IKernelStatus): void {
    if (this._feedbackPark !== null && kernel.park && kernel.park.state !== this._feedbackPark) {
      this._feedbackPark = null;
      setHidden(this.feedback, true); // the line says what happened since
    }
    const buttons = parkButtons(kernel.park || null);
    setButton(this._parkButton, buttons.park, this._parkBusy);
    setButton(this._resumeButton, buttons.resume, this._parkBusy);
  }

  private async _request(request: { cap: string } | { reset: true }): Promise<void> {
    const trans = this._trans;
    this._setButton.disabled = this._resetButton.disabled = true;
    try {
      const result = await this._actions.setCap(this._kernelId, request);
      const labels: Record<string, string> = {
        granted: trans.__('Granted'),
        clamped: trans.__('Clamped'),
        refused: trans.__('Refused'),
        invalid: trans.__('Not a cap')
      };
      this._showFeedback(
        labelled(labels[result.outcome] || result.outcome, result.message),
        result.outcome === 'granted' ? 'ok' : result.outcome === 'clamped' ? 'warning' : 'over'
      );
      if (result.outcome === 'granted' || result.outcome === 'clamped') {
        this._capInput.value = '';
      }
    } catch (error) {
      this._showFeedback(labelled(trans.__('Failed'), String((error as Error)?.message || error)), 'over');
    } finally {
      this._setButton.disabled = this._resetButton.disabled = false;
    }
  }

  private async _parkOrResume(action: 'park' | 'resume'): Promise<void> {
    this._parkBusy = true;
    this._parkButton.disabled = this._resumeButton.disabled = true;
    let park: IKernelPark | null = null;
    try {
      const result = await this._actions.park(this._kernelId, action);
      const feedback = parkFeedback(action, result.outcome, result.message, result.park);
      this._showFeedback(feedback.text, feedback.level);
      park = result.park;
      // An accepted request's words ("Parks when its current cell ends") last until the state moves on.
      this._feedbackPark = result.outcome === 'accepted' && result.park ? result.park.state : null;
    } catch (error) {
      const failed = action === 'park' ? this._trans.__('Park failed') : this._trans.__('Resume failed');
      this._showFeedback(labelled(failed, String((error as Error)?.message || error)), 'over');
    } finally {
      this._parkBusy = false;
      this._parkSettled(park);
    }
  }

  private async _shutdown(): Promise<void> {
    const kernel = this._kernel();
    if (!kernel) {
      return;
    }
    this._shutdownButton.disabled = true;
    try {
      await this._actions.shutdown(kernel);
    } catch (error) {
      this._showFeedback(
        labelled(this._trans.__('Shut down failed'), String((error as Error)?.message || error)),
        'over'
      );
    } finally {
      this._shutdownButton.disabled = false;
    }
  }

  private _showFeedback(text: string, level: string): void {
    this._feedbackPark = null;
    setText(this.feedback, text);
    setLevel(this.feedback, level);
    setHidden(this.feedback, false);
  }
}
