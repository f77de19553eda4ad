/**
 * What the sidebar says in the server's words: a refused cap's reason (a "%" shown once) and a
 * stalled GPU monitor. Against the real `jupyter lab` of run.sh (two static 80 GiB GPUs).
 */
import { expect, test } from '@jupyterlab/galata';

import { openPanel, PANEL, startKernel } from './helpers';

test.describe('GPU quota sidebar: the server in its own words', () => {
  test('a refused cap shows the server\'s reason, a percent sign once', async ({ page }) => {
    const kernelId = await startKernel(page);
    try {
      await openPanel(page);
      const row = page.locator(`${PANEL} li.jp-GpuQuota-kernel[data-kernel-id="${kernelId}"]`);
      await expect(row).toBeVisible();
      await row.locator('.jp-GpuQuota-capInput').fill('2.5');
      await row.getByRole('button', { name: 'Set cap' }).click();
      const feedback = row.locator('.jp-GpuQuota-feedback');
      await expect(feedback).toContainText('Not a cap');
      await expect(feedback).toContainText('at most 1 (100%)');
      await expect(feedback).not.toContainText('%%');
    } finally {
      await page.request.delete(`/api/kernels/${kernelId}`);
    }
  });

  test('a stalled monitor is said at the top of the panel, with since when', async ({ page }) => {
    const message =
      'no GPU sample since 2026-11-29 10:00:00 UTC: an NVML call has not returned for 9 s; ' +
      'usage is unknown and the watchdog cannot act until it does';
    // The real server's answer, with the monitor's part as a server whose NVML call hangs sends it.
    await page.route(/\/api\/gpu-quota\/status/, async route => {
      const response = await route.fetch();
      const body = await response.json();
      body.monitor = { ...body.monitor, state: 'stalled', message, stalled_after: 3 };
      await route.fulfill({ response, json: body });
    });
    await openPanel(page);
    const banner = page.locator(`${PANEL} .jp-GpuQuota-message`);
    await expect(banner).toBeVisible();
    await expect(banner).toHaveAttribute('data-monitor', 'stalled');
    await expect(banner).toHaveText(`GPU monitor stalled, usage unknown: ${message}`);
    await expect(banner).toHaveClass(/jp-mod-over/);
    // The GPUs are still listed under it.
    await expect(page.locator(`${PANEL} .jp-GpuQuota-device`)).toHaveCount(2);
    // And it goes when the monitor is back.
    await page.unroute(/\/api\/gpu-quota\/status/);
    await expect(banner).toBeHidden({ timeout: 10000 });
  });
});
