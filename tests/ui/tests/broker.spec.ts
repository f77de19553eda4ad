/**
 * The broker in the sidebar, against the real server of run.sh (its parker and broker; only NVML and the
 * checkpoint driver are the scenario's fakes, ../ui_scenario.py): two notebooks parked from the sidebar, one
 * whose restore fails (lost: what was on the GPU is gone) and one whose resume waits for device memory that
 * processes outside this server hold (the broker has no idle kernel to park for it). What a user sees at the
 * default sidebar width in the light theme: each row's line in its words and colour, whole, the raw reason on
 * hover, the controls that make sense (Resume disabled while it waits; a lost kernel only Shut down), and their
 * chart's bands. Screenshots go to build/ui.
 */
import { expect, IJupyterLabPageFixture, test } from '@jupyterlab/galata';
import type { Locator } from '@playwright/test';

import {
  GiB,
  newNotebookKernel,
  openPanel,
  PANEL,
  row,
  setScenario,
  shot,
  SIDEBAR_WIDTHS,
  transitionsDone
} from './helpers';

/** The colour a CSS variable of the theme gives text, as the browser computes it. */
async function themeColour(page: IJupyterLabPageFixture, variable: string): Promise<string> {
  return page.evaluate(name => {
    const probe = document.createElement('span');
    probe.style.color = `var(${name})`;
    document.body.append(probe);
    const colour = getComputedStyle(probe).color;
    probe.remove();
    return colour;
  }, variable);
}

/** The line shows all of its text: no line clamp, no overflow cut it. */
async function expectWhole(line: Locator): Promise<void> {
  const cut = await line.evaluate(node => node.scrollHeight > node.clientHeight + 1);
  expect(cut, `${await line.textContent()}: cut`).toBe(false);
}

test.describe('the broker in the sidebar', () => {
  test.afterEach(async ({ page }) => {
    await setScenario(page, {}); // an idle GPU for the next test
  });

  test('a kernel waiting for device memory and a lost one, at the default width, light theme', async ({
    page,
    tmpPath
  }) => {
    test.setTimeout(180000); // two notebooks, two parks, a failed restore and a wait, each a few samples long
    await openPanel(page);
    expect(await page.evaluate(() => document.body.dataset.jpThemeLight)).toBe('true');
    expect(Math.round((await page.locator(PANEL).boundingBox())!.width)).toBe(SIDEBAR_WIDTHS.default);
    const waits = await newNotebookKernel(page, tmpPath, 'waits.ipynb');
    const lost = await newNotebookKernel(page, tmpPath, 'lost.ipynb');
    const usage = { [waits.pid]: { [waits.uuid]: 4 * GiB }, [lost.pid]: { [lost.uuid]: 6 * GiB } };
    await setScenario(page, { usage });

    // Both parked from the sidebar by the server's parker (the fake driver moves their bytes to the host).
    for (const kernel of [waits, lost]) {
      const park = row(page, kernel.id).getByRole('button', { name: 'Park' });
      await expect(park).toBeEnabled({ timeout: 30000 }); // once NVML has seen its memory
      await park.click();
      await expect(row(page, kernel.id).locator('.jp-GpuQuota-line')).toHaveText(/^parked since \d\d:\d\d/, {
        timeout: 30000
      });
    }

    // The lost kernel: its resume runs (there is room) and the driver's restore fails, as a full device's does.
    await setScenario(page, { usage, fail_restores: 1 });
    const lostRow = row(page, lost.id);
    const lostLine = lostRow.locator('.jp-GpuQuota-line');
    await lostRow.getByRole('button', { name: 'Resume' }).click();
    await expect(lostLine).toHaveAttribute('data-park-state', 'lost', { timeout: 30000 });
    await expect(lostLine).toHaveText(
      'lost: its GPU memory could not be brought back: save what is in host memory, then restart the kernel'
    );
    await expect(lostLine).toHaveClass(/jp-mod-over/);
    await expect(lostLine).toHaveAttribute('title', /^its GPU memory \(6\.0 GiB\) could not be brought back: cuCheck/);
    await expect(lostLine).toHaveAttribute('title', /then restart the kernel; that frees its host memory$/);
    await expect(lostRow.getByRole('button', { name: 'Park' })).toBeHidden();
    await expect(lostRow.getByRole('button', { name: 'Resume' })).toBeHidden();
    await expect(lostRow.getByRole('button', { name: 'Set cap' })).toBeHidden();
    await expect(lostRow.getByRole('button', { name: 'Reset' })).toBeHidden();
    await expect(lostRow.getByRole('button', { name: 'Shut down' })).toBeEnabled();

    // The waiting kernel: processes that are no kernel's fill its GPU, and no idle kernel can park for it.
    await setScenario(page, { usage, other_used: { [waits.uuid]: 78 * GiB } });
    const waitsRow = row(page, waits.id);
    const waitsLine = waitsRow.locator('.jp-GpuQuota-line');
    await waitsRow.getByRole('button', { name: 'Resume' }).click();
    const waiting = new RegExp(
      `^waiting for device memory( for \\d+ s)? \\(limit 5 min\\): needs 4\\.0 GiB on GPU ${waits.index}$`
    );
    await expect(waitsLine).toHaveText(waiting, { timeout: 30000 });
    await expect(waitsLine).toHaveText(/ for \d+ s /, { timeout: 10000 }); // how long, counted by the server
    await expect(waitsLine).toHaveClass(/jp-mod-warning/);
    await expect(waitsLine).toHaveAttribute('title', new RegExp(`^needs 4\\.0 GiB on GPU ${waits.index}; GPU`));
    const resume = waitsRow.getByRole('button', { name: 'Resume' });
    await expect(resume).toBeDisabled();
    await expect(resume).toHaveAttribute('title', /as soon as there is room for it/);
    await expect(waitsRow.getByRole('button', { name: 'Park' })).toBeHidden();
    await expect(waitsRow.getByRole('button', { name: 'Shut down' })).toBeEnabled();
    // Still lost: nothing brings it back, whatever the room.
    await expect(lostLine).toHaveAttribute('data-park-state', 'lost');

    // Their charts mark the periods, and the legend says what the marks are.
    const waitsChart = waitsRow.locator('.jp-GpuQuota-chart');
    const lostChart = lostRow.locator('.jp-GpuQuota-chart');
    await expect(waitsChart.locator('.jp-GpuQuota-chartPark[data-state="waiting"]')).toHaveCount(1, {
      timeout: 30000
    });
    await expect(lostChart.locator('.jp-GpuQuota-chartPark[data-state="lost"]')).toHaveCount(1);
    await expect(lostChart).toHaveAttribute('title', /Lost \(its GPU memory could not be brought back\): \d\d:\d\d/);
    const legend = page.locator(`${PANEL} .jp-GpuQuota-legend`);
    await expect(legend.locator('.jp-GpuQuota-legend-waiting')).toHaveText('waiting to resume');
    await expect(legend.locator('.jp-GpuQuota-legend-lost')).toHaveText('lost');

    // What a user sees: both lines whole at the default width, in the theme's warning and error colours.
    await waitsRow.scrollIntoViewIfNeeded();
    await expectWhole(waitsLine);
    await expectWhole(lostLine);
    expect(await waitsLine.evaluate(node => getComputedStyle(node).color)).toBe(
      await themeColour(page, '--jp-warn-color1')
    );
    expect(await lostLine.evaluate(node => getComputedStyle(node).color)).toBe(
      await themeColour(page, '--jp-error-color1')
    );
    await page.locator(PANEL).evaluate(node => node.scrollTo(0, 0));
    await transitionsDone(page);
    await page.locator(PANEL).screenshot({ path: shot('broker-light.png') });
  });
});
