/**
 * gpu-quota-ext's JupyterLab plugin: a "GPU quota" sidebar and a status bar item, both fed by one
 * Lumino Poll of GET /api/gpu-quota/status. The notebook toolbar shows nothing new.
 */

import {
  ILayoutRestorer,
  JupyterFrontEnd,
  JupyterFrontEndPlugin
} from '@jupyterlab/application';
import { Dialog, ICommandPalette, showDialog } from '@jupyterlab/apputils';
import { INotebookTracker } from '@jupyterlab/notebook';
import { ISettingRegistry } from '@jupyterlab/settingregistry';
import { IStatusBar } from '@jupyterlab/statusbar';
import { ITranslator, nullTranslator } from '@jupyterlab/translation';
import { LabIcon } from '@jupyterlab/ui-components';

import { requestCap, requestPark } from './api';
import { DEFAULT_INTERVAL_MS, DEFAULT_WARNING_THRESHOLD, QuotaModel } from './model';
import { PANEL_ID, QuotaPanel } from './panel';
import { IKernelStatus } from './contract';
import { QuotaStatusItem } from './status';

const PLUGIN_ID = 'gpu-quota-ext:plugin';
const COMMAND_OPEN = 'gpu-quota-ext:open';

const GPU_ICON_SVG = `<svg xmlns="http://www.w3.org/2000/svg" width="16" height="16" viewBox="0 0 24 24">
  <g class="jp-icon3" fill="#616161">
    <path d="M7 2h2v2h2V2h2v2h2V2h2v2h1a3 3 0 0 1 3 3v1h2v2h-2v2h2v2h-2v2h2v2h-2v1a3 3 0 0 1-3 3h-1v2h-2v-2h-2v2h-2v-2H9v2H7v-2H6a3 3 0 0 1-3-3v-1H1v-2h2v-2H1v-2h2V8H1V6h2V7a3 3 0 0 1 3-3h1V2zm-1 4a1 1 0 0 0-1 1v10a1 1 0 0 0 1 1h12a1 1 0 0 0 1-1V7a1 1 0 0 0-1-1H6zm2 3h8v6H8V9z"/>
  </g>
</svg>`;

export const gpuIcon = new LabIcon({ name: 'gpu-quota-ext:gpu', svgstr: GPU_ICON_SVG });

const plugin: JupyterFrontEndPlugin<void> = {
  id: PLUGIN_ID,
  description: "A sidebar and a status bar item: every kernel's GPU memory usage against its cap.",
  autoStart: true,
  optional: [
    ISettingRegistry,
    ITranslator,
    INotebookTracker,
    IStatusBar,
    ILayoutRestorer,
    ICommandPalette
  ],
  activate: (
    app: JupyterFrontEnd,
    settingRegistry: ISettingRegistry | null,
    translator: ITranslator | null,
    notebooks: INotebookTracker | null,
    statusBar: IStatusBar | null,
    restorer: ILayoutRestorer | null,
    palette: ICommandPalette | null
  ) => {
    const trans = (translator || nullTranslator).load('gpu_quota_ext');
    const serverSettings = app.serviceManager.serverSettings;
    let panel: QuotaPanel | null = null;
    let statusItem: QuotaStatusItem | null = null;

    const model: QuotaModel = new QuotaModel({
      serverSettings,
      interval: DEFAULT_INTERVAL_MS,
      // Poll while the panel shows, or while the status bar has a current kernel to report on.
      isWatched: (): boolean =>
        !!(panel && panel.isVisible) || (statusItem !== null && model.state.currentKernelId !== null),
      // The usage charts are in the panel only: the history is asked for while it shows.
      wantsHistory: (): boolean => !!(panel && panel.isVisible)
    });

    const shutdown = async (kernel: IKernelStatus): Promise<boolean> => {
      const result = await showDialog({
        title: trans.__('Shut down kernel?'),
        body: trans.__(
          'Shut down the kernel of %1? Its variables and GPU memory are released.',
          kernel.path || kernel.id
        ),
        buttons: [
          Dialog.cancelButton({ label: trans.__('Cancel') }),
          Dialog.warnButton({ label: trans.__('Shut Down') })
        ]
      });
      if (!result.button.accept) {
        return false;
      }
      // DELETE /api/kernels/<id> through the kernel manager, so every open view of it learns.
      await app.serviceManager.kernels.shutdown(kernel.id);
      model.dispatch({ type: 'removed', kernelId: kernel.id });
      void model.refresh(true);
      return true;
    };

    panel = new QuotaPanel(model, trans, {
      setCap: async (kernelId, request) => {
        const result = await requestCap(serverSettings, kernelId, request);
        void model.refresh(true);
        return result;
      },
      park: async (kernelId, action) => {
        const result = await requestPark(serverSettings, kernelId, action);
        void model.refresh(true);
        return result;
      },
      shutdown,
      open: path => void app.commands.execute('docmanager:open', { path })
    });
    panel.title.icon = gpuIcon;
    app.shell.add(panel, 'left', { rank: 900, type: 'GPU quota' });
    if (restorer) {
      restorer.add(panel, PANEL_ID);
    }

    app.commands.addCommand(COMMAND_OPEN, {
      label: trans.__('Show GPU Quota'),
      caption: trans.__("Every kernel's GPU memory usage against its cap"),
      icon: gpuIcon,
      execute: () => app.shell.activateById(PANEL_ID)
    });
    if (palette) {
      palette.addItem({ command: COMMAND_OPEN, category: trans.__('Kernel') });
    }

    if (statusBar) {
      statusItem = new QuotaStatusItem(model, trans);
      statusBar.registerStatusItem('gpu-quota-ext:status', {
        item: statusItem,
        align: 'left',
        rank: 4,
        isActive: () => statusItem!.active,
        activeStateChanged: statusItem.activeChanged
      });
      statusItem.node.addEventListener('click', () => app.shell.activateById(PANEL_ID));
    }

    // The current kernel: the active notebook's (it stays current while the sidebar has focus).
    if (notebooks) {
      let watched: any = null;
      const follow = () => {
        const context = notebooks.currentWidget?.sessionContext ?? null;
        if (context !== watched) {
          watched?.kernelChanged.disconnect(follow);
          watched?.statusChanged.disconnect(follow);
          watched = context;
          context?.kernelChanged.connect(follow);
          context?.statusChanged.connect(follow);
        }
        model.setCurrentKernel(context?.session?.kernel?.id ?? null);
      };
      notebooks.currentChanged.connect(follow);
      follow();
    }

    // A hidden page stops polling (the Poll's standby); coming back asks at once.
    document.addEventListener('visibilitychange', () => {
      if (!document.hidden) {
        void model.refresh();
      }
    });

    if (settingRegistry) {
      void settingRegistry
        .load(PLUGIN_ID)
        .then(settings => {
          const apply = () => {
            const interval = settings.get('refreshInterval').composite as number;
            const threshold = settings.get('warningThreshold').composite as number;
            model.interval = interval > 0 ? interval : DEFAULT_INTERVAL_MS;
            const t = threshold > 0 ? threshold : DEFAULT_WARNING_THRESHOLD;
            panel!.threshold = t;
            if (statusItem) {
              statusItem.threshold = t;
            }
            panel!.update();
          };
          settings.changed.connect(apply);
          apply();
        })
        .catch(reason => console.error('gpu-quota-ext: cannot load settings', reason));
    }
  }
};

export default plugin;
