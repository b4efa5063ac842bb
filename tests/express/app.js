// The Express upstream of the path-normalization test: default routing, which
// is not strict (`/v1/payments/` runs the `/v1/payments` handler) and not
// case-sensitive. Counts executions per Idempotency-Key.
const express = require("express");

const app = express();
const executions = {};
let total = 0;

app.post("/v1/payments", express.json(), (req, res) => {
  const key = req.get("idempotency-key") || "";
  executions[key] = (executions[key] || 0) + 1;
  total += 1;
  res.status(201).json({ id: `pay_${total}`, path: req.path });
});

app.get("/executions", (_req, res) => res.json(executions));

app.listen(Number(process.argv[2]), "127.0.0.1", () => console.log("listening"));
