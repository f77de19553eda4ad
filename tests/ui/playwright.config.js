/**
 * Galata against the `jupyter lab` that run.sh starts (TARGET_URL), in Debian's Chromium: the tests, or
 * with GQ_UI_PICTURES set (`run.sh --pictures`) only the pictures for the docs.
 */
const baseConfig = require('@jupyterlab/galata/lib/playwright-config');
const chromium = require('./chromium');

module.exports = {
  ...baseConfig,
  testDir: './tests',
  ...(process.env.GQ_UI_PICTURES
    ? { testMatch: 'pictures.spec.ts', timeout: 600000 }
    : { testIgnore: 'pictures.spec.ts', timeout: 90000 }),
  retries: 0,
  workers: 1,
  reporter: [['list']],
  use: {
    ...baseConfig.use,
    baseURL: process.env.TARGET_URL || 'http://127.0.0.1:8888',
    viewport: { width: 1280, height: 800 },
    trace: 'off',
    video: 'off',
    launchOptions: {
      executablePath: chromium.executablePath,
      args: chromium.args
    }
  }
};
