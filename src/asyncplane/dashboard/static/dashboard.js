// asyncplane dashboard: live updates. Every 2 seconds the page asks the server for its
// live part again (the same URL, with the X-Asyncplane-Live header) and puts it in place.
// The server renders and escapes everything; this script only swaps trusted markup and
// never evaluates anything it receives.
"use strict";
(function () {
  const EVERY_MS = 2000;
  const live = document.getElementById("live");
  const status = document.getElementById("status");
  if (!live || document.body.dataset.live !== "1") return;
  let busy = false;

  function say(text) {
    status.textContent = text;
    status.hidden = !text;
  }

  async function refresh() {
    if (busy || document.hidden) return;
    // A form being used (a focused button) is not swapped away under the user's hand.
    if (document.activeElement && live.contains(document.activeElement) &&
        document.activeElement.tagName !== "BODY") return;
    // Nor is text the user has selected (an error to copy, say).
    const selection = window.getSelection();
    if (selection && !selection.isCollapsed && live.contains(selection.anchorNode)) return;
    busy = true;
    try {
      const response = await fetch(window.location.pathname + window.location.search, {
        headers: { "X-Asyncplane-Live": "1" },
        credentials: "same-origin",
        cache: "no-store",
      });
      if (!response.ok) {
        say("live updates paused: the dashboard answered " + response.status);
        return;
      }
      live.innerHTML = await response.text();
      say("");
    } catch (error) {
      say("live updates paused: the dashboard cannot be reached");
    } finally {
      busy = false;
    }
  }

  window.setInterval(refresh, EVERY_MS);
  // One refresh now, awaited: for the browser tests, which cannot wait on a timer.
  window.asyncplaneRefresh = refresh;
})();
