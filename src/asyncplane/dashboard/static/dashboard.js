// asyncplane dashboard: live updates. Every 2 seconds the page asks the server for its
// live part again (the same URL, with the X-Asyncplane-Live header) and puts it in place.
// The server renders and escapes everything; this script only swaps trusted markup and
// never evaluates anything it receives.
"use strict";
(function () {
  const EVERY_MS = 2000;
  // The server answers within its own time limit (503 past it); a request still out after
  // this long (a dashboard process that stopped answering) is given up, and said so.
  const GIVE_UP_MS = Number(document.body.dataset.giveUpMs) || 30000;
  const live = document.getElementById("live");
  const status = document.getElementById("status");
  if (!live || document.body.dataset.live !== "1") return;
  let busy = false;

  function say(text) {
    status.textContent = text;
    status.hidden = !text;
  }

  // A form being used (a focused button) is not swapped away under the user's hand, nor
  // text the user has selected in it (an error to copy, say).
  function inUse() {
    if (document.activeElement && live.contains(document.activeElement) &&
        document.activeElement.tagName !== "BODY") return true;
    const selection = window.getSelection();
    return Boolean(selection && !selection.isCollapsed && selection.containsNode(live, true));
  }

  // A signal that gives a request up after GIVE_UP_MS; `timedOut()` says whether it did
  // (a browser without abort reasons rejects with an AbortError all the same).
  function givingUp() {
    const controller = new AbortController();
    let late = false;
    const timer = window.setTimeout(function () {
      late = true;
      controller.abort();
    }, GIVE_UP_MS);
    return {
      signal: controller.signal,
      timedOut: function () { return late; },
      done: function () { window.clearTimeout(timer); },
    };
  }

  async function refresh() {
    if (busy || document.hidden || inUse()) return;
    busy = true;
    const limit = givingUp();
    try {
      const response = await fetch(window.location.pathname + window.location.search, {
        headers: { "X-Asyncplane-Live": "1" },
        credentials: "same-origin",
        cache: "no-store",
        signal: limit.signal,
      });
      if (!response.ok) {
        say("live updates paused: the dashboard answered " + response.status);
        return;
      }
      const fresh = await response.text();
      if (inUse()) return;  // (taken up while the answer was on its way)
      live.innerHTML = fresh;
      say("");
    } catch (error) {
      say(limit.timedOut()
        ? "live updates paused: the dashboard did not answer in " +
          Math.round(GIVE_UP_MS / 1000) + " s"
        : "live updates paused: the dashboard cannot be reached");
    } finally {
      limit.done();
      busy = false;
    }
  }

  window.setInterval(refresh, EVERY_MS);
  // The refresh itself, for the browser tests to run and await (they wait on no timer).
  window.asyncplaneRefresh = refresh;
})();
