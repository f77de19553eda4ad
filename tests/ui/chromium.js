// How Debian's Chromium is launched here, as root, with no network beyond loopback (FACTS.md):
// shared by the Galata tests (playwright.config.js) and the sidebar benchmark.
module.exports = {
  executablePath: process.env.CHROMIUM_PATH || '/usr/bin/chromium',
  args: [
    '--headless',
    '--no-sandbox',
    '--disable-gpu',
    '--disable-quic',
    '--no-first-run',
    '--disable-background-networking',
    '--disable-component-update',
    '--disable-sync'
  ]
};
