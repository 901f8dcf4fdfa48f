// Allure 3 configuration for numalign's reports: one self-contained HTML file, with the
// history of earlier runs carried in history.jsonl (keep that file between CI runs).
import { defineConfig } from "allure";

export default defineConfig({
  name: "numalign alignment",
  output: process.env.ALLURE_OUTPUT ?? "./allure-report",
  historyPath: process.env.ALLURE_HISTORY ?? "./history.jsonl",
  plugins: {
    awesome: {
      options: {
        singleFile: true,
        reportLanguage: "en",
        groupBy: ["epic", "feature", "story"],
      },
    },
  },
});
