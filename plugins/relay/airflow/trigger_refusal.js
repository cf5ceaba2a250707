/* Relay in Airflow's UI: a refused trigger's reason where the person is looking.

Airflow's trigger dialog shows the API's answer at the top of a long dialog (scrolled out of view once the person
has scrolled down to Trigger), and its toast says only "Bad Request". Relay's refusals (relay.airflow.form.explain,
through relay.airflow.api_plugin) start with "Nothing was triggered". When one appears, this script scrolls it into
view, puts its first sentence in the toast in place of "Bad Request", and marks both so that they wrap at words.
Any other error is left as Airflow shows it. Injected into the UI's page by relay.airflow.api_plugin.UiScriptMiddleware.
*/
(() => {
  const MARK = "Nothing was triggered";
  const FRESH_MS = 30000; // a toast that opens this long after the refusal is about something else
  let reason = null;
  let seenAt = 0;

  const refusalIn = (dialog) => {
    // Airflow's ErrorAlert: Chakra's Alert (class chakra-alert__root; no role in Airflow 3.3's build).
    for (const alert of dialog.querySelectorAll('[class*="alert__root"], [role="alert"]')) {
      const text = alert.innerText || "";
      const at = text.indexOf(MARK);
      if (at >= 0) return { alert, text: text.slice(at).trim() };
    }
    return null;
  };

  // The toast is small: the first sentence of each problem (the dialog holds the whole reason, with an example).
  const inShort = (text) => {
    const problems = text.slice(MARK.length).replace(/^[.:]\s*/, "").split("\n").map((l) => l.replace(/^- /, ""));
    const first = problems.filter(Boolean).map((l) => (l.match(/^.*?\.(?=\s|$)/) || [l])[0]);
    return `${first.join(" ")} The whole reason is at the top of the dialog.`;
  };

  const update = () => {
    for (const dialog of document.querySelectorAll('[role="dialog"]')) {
      const found = refusalIn(dialog);
      if (found && !found.alert.classList.contains("relay-refusal")) {
        found.alert.classList.add("relay-refusal");
        found.alert.scrollIntoView({ block: "nearest" });
        reason = inShort(found.text);
        seenAt = Date.now();
      }
    }
    if (reason === null || Date.now() - seenAt > FRESH_MS) return;
    for (const toast of document.querySelectorAll('[data-scope="toast"][data-part="root"]')) {
      const said = toast.querySelector('[data-part="description"]');
      if (!said || said.hidden || said.textContent.trim() !== "Bad Request") continue;
      // A sibling of Airflow's own text, which stays in place (hidden) for React to manage.
      const words = document.createElement("div");
      words.className = "relay-refusal relay-reason";
      words.textContent = reason;
      said.hidden = true;
      said.after(words);
      toast.classList.add("relay-refusal");
    }
  };

  const style = document.createElement("style");
  style.textContent = `
    .relay-refusal, .relay-refusal * { word-break: normal !important; overflow-wrap: break-word !important; }
    .relay-reason { white-space: pre-wrap; font-size: 0.875rem; max-width: 36rem; }
  `;
  document.head.append(style);
  new MutationObserver(update).observe(document.documentElement, { childList: true, subtree: true });
})();
