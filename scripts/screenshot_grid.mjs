// The README's picture of the Airflow UI: a run's grid with its chunks, from the local stack.
// Needs Debian's chromium (apt-get install chromium) and playwright-core (npm i playwright-core):
//   AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS=True ./scripts/demo.sh --keep-running
//   node scripts/screenshot_grid.mjs relay_demo "<dag run id>" docs/airflow-grid.png
//   .venv/bin/python -m relay stack down
import { chromium } from "playwright-core";

const [dagId, runId, out] = process.argv.slice(2);
const base = process.env.AIRFLOW_URL ?? "http://127.0.0.1:8080";
const browser = await chromium.launch({ executablePath: "/usr/bin/chromium", args: ["--no-sandbox"] });
const page = await browser.newPage({ viewport: { width: 1500, height: 860 } });
await page.goto(`${base}/dags/${dagId}/runs/${encodeURIComponent(runId)}`, { waitUntil: "networkidle" });
// Open every task group, so each chunk's train, validate and publish show (and chunk 2's retry).
await page.getByRole("button", { name: "Expand all task groups" }).click();
await page.waitForTimeout(2500);
await page.screenshot({ path: out });
await browser.close();
