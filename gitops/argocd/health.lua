-- Argo CD health check for pelican.io/ConsumerGroupPolicy.
-- Install it under resource.customizations.health.pelican.io_ConsumerGroupPolicy in argocd-cm (see docs/src/gitops.md).
--
-- Ready=True (for the current generation) -> Healthy; Stalled=True -> Degraded;
-- anything else (Reconciling, retrying, not yet observed) -> Progressing.
local hs = {status = "Progressing", message = "Waiting for the operator"}
if obj.status == nil or obj.status.conditions == nil then
  return hs
end
if obj.status.observedGeneration ~= nil and obj.metadata.generation ~= nil
    and obj.status.observedGeneration < obj.metadata.generation then
  hs.message = "Waiting for the operator to observe the latest spec"
  return hs
end
local ready, stalled, reconciling
for _, condition in ipairs(obj.status.conditions) do
  if condition.type == "Ready" then ready = condition end
  if condition.type == "Stalled" then stalled = condition end
  if condition.type == "Reconciling" then reconciling = condition end
end
if stalled ~= nil and stalled.status == "True" then
  hs.status = "Degraded"
  hs.message = stalled.reason .. ": " .. (stalled.message or "")
  return hs
end
if ready ~= nil and ready.status == "True" then
  hs.status = "Healthy"
  hs.message = ready.message or "Ready"
  return hs
end
if ready ~= nil then
  hs.message = ready.reason .. ": " .. (ready.message or "")
elseif reconciling ~= nil then
  hs.message = reconciling.reason
end
return hs
