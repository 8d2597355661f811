-- Argo CD health check for pelican.io/DeadLetterRedrive.
-- Install it under resource.customizations.health.pelican.io_DeadLetterRedrive in argocd-cm (see docs/src/gitops.md).
--
-- Succeeded -> Healthy; Failed -> Degraded (with the reason); Suspended -> Suspended;
-- Pending or Running (or not yet seen by the operator) -> Progressing, with what it waits for or how far it got.
local hs = {status = "Progressing", message = "Waiting for the operator"}
if obj.status == nil or obj.status.phase == nil then
  return hs
end
local function condition(type)
  for _, c in ipairs(obj.status.conditions or {}) do
    if c.type == type then return c end
  end
end
local phase = obj.status.phase
if phase == "Succeeded" then
  hs.status = "Healthy"
  hs.message = (condition("Complete") or {}).message or "Succeeded"
elseif phase == "Failed" then
  local failed = condition("Failed") or {reason = "Failed"}
  hs.status = "Degraded"
  hs.message = failed.reason .. ": " .. (failed.message or "")
elseif phase == "Suspended" then
  hs.status = "Suspended"
  hs.message = "spec.suspend is true; moved " .. tostring(obj.status.moved or 0)
elseif phase == "Running" then
  hs.message = "moved " .. tostring(obj.status.moved or 0) .. " of " .. tostring(obj.status.toMove or "?")
else
  local waiting = condition("Reconciling")
  if waiting ~= nil then hs.message = waiting.reason .. ": " .. (waiting.message or "") end
end
return hs
