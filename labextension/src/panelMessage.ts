/**
 * The one line at the top of the sidebar, decided from the state: what is wrong with the poll or the server
 * first, else what the server says of its GPU monitor (a stalled monitor means every usage figure below is
 * unknown), else nothing. The raw words go on hover, unless the line already says them. Apart from the
 * panel so that the panel only writes what is decided here.
 */

import { TranslationBundle } from '@jupyterlab/translation';

import { IMonitorNotice } from './derive';
import { labelled, reasonText } from './format';
import { IState } from './state';
import { monitorNoticeText } from './usageText';

export interface IPanelMessage {
  /** Empty: no line. */
  text: string;
  /** The tooltip: the raw detail, when the text does not already hold it. */
  title: string;
  level: string;
  /** `data-monitor`: the monitor's problem when the line is about the monitor, else empty. */
  monitor: string;
}

/** What is wrong with the poll or the server, in words, and its raw detail; null when nothing is. */
export function pollProblem(trans: TranslationBundle, state: IState): { text: string; detail: string } | null {
  switch (state.phase) {
    case 'loading':
      return { text: trans.__('Loading GPU quotas…'), detail: '' };
    case 'missing':
      return { text: trans.__('The gpu-quota-ext server extension is not enabled on this server.'), detail: '' };
    case 'no-gpu': {
      const said = reasonText(state.status?.reasons?.no_gpu, state.status?.message);
      return said
        ? { text: labelled(trans.__('No GPU on this server'), said.words), detail: said.detail }
        : { text: trans.__('No GPU on this server.'), detail: '' };
    }
    case 'error':
      return { text: labelled(trans.__('Cannot read GPU quotas, retrying'), state.error), detail: '' };
    default:
      return null;
  }
}

/** The line for this state, given what monitorNotice() says of the server's monitor. */
export function panelMessage(
  trans: TranslationBundle,
  state: IState,
  notice: IMonitorNotice | null
): IPanelMessage {
  const problem = pollProblem(trans, state);
  const text = problem ? problem.text : notice ? monitorNoticeText(trans, notice) : '';
  const detail = problem ? problem.detail : notice ? notice.detail : '';
  return {
    text,
    title: detail && !text.includes(detail) ? detail : '',
    level:
      state.phase === 'error' || state.phase === 'missing' ? 'over' : notice && !problem ? notice.level : 'ok',
    monitor: notice && !problem ? notice.problem : ''
  };
}
