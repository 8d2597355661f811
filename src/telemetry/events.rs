//! Kubernetes Events about policies.

use k8s_openapi::api::core::v1::ObjectReference;
use kube::Client;
use kube::runtime::events::{Event, Recorder, Reporter};

/// Publishes Events through kube's [`Recorder`], one fresh recorder per Event.
///
/// A shared `Recorder` keeps every Event it sent for six minutes (to turn repeats into a series) and scans all of
/// them on each publish: with thousands of policies each announcing its group and its readiness, that cache held
/// tens of thousands of Events and every publish waited on one lock to walk it. Pelican announces transitions, not
/// repeats, so it has no series to build.
#[derive(Clone)]
pub struct Events {
    client: Client,
    reporter: Reporter,
}

impl Events {
    pub fn new(client: Client, reporter: Reporter) -> Events {
        Events { client, reporter }
    }

    pub async fn publish(&self, event: &Event, about: &ObjectReference) -> Result<(), kube::Error> {
        Recorder::new(self.client.clone(), self.reporter.clone()).publish(event, about).await
    }
}
