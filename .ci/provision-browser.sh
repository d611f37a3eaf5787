#!/usr/bin/env bash
# Provision the viewer's browser tests (tests/viewer, docs/viewer.md): Debian's headless Chromium
# (/usr/bin/chromium) and Playwright for Python, which drives it through executable_path.
#
# Idempotent and fast when both are there. Playwright's own browser download (`playwright install`)
# is never run: the tests start Debian's Chromium with the flags that keep it off the network.
set -euo pipefail
cd "$(dirname "$0")/.."
started=$(date +%s)

if [ -x /usr/bin/chromium ]; then
    echo "chromium: $(/usr/bin/chromium --version 2>/dev/null | head -1)"
else
    echo "installing Debian's chromium ..."
    sudo_=""
    [ "$(id -u)" -eq 0 ] || sudo_="sudo"
    $sudo_ apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo_ apt-get install -y -qq chromium >/dev/null
    /usr/bin/chromium --version
fi

if python3 -c "import playwright.sync_api" 2>/dev/null; then
    echo "playwright for python: $(python3 -m pip show playwright 2>/dev/null | awk '/^Version/{print $2}')"
else
    echo "installing Playwright for Python (the package only; no browser download) ..."
    python3 -m pip install --quiet --disable-pip-version-check 'playwright>=1.40'
fi
# A smoke check that Playwright can start this Chromium headless, for a closed network.
python3 - <<'PY'
import tempfile
from playwright.sync_api import sync_playwright
flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
with tempfile.TemporaryDirectory() as profile, sync_playwright() as pw:
    ctx = pw.chromium.launch_persistent_context(profile, executable_path="/usr/bin/chromium", headless=True, args=flags)
    page = ctx.new_page()
    page.set_content("<p id=ok>ok</p>")
    assert page.text_content("#ok") == "ok"
    ctx.close()
print("playwright drives /usr/bin/chromium headless")
PY
echo "the browser is provisioned in $(( $(date +%s) - started )) s"
