//! Reconciles against a scripted API server (controller-rs's fixtures): a client whose every request goes to a
//! handle the test reads, checks and answers. Unit tests only.

use http::{Method, Request, Response};
use kube::client::Body;
use tower_test::mock;

pub type Handle = mock::Handle<Request<Body>, Response<Body>>;

/// A client in namespace `apps` and the handle that receives its requests.
pub fn client() -> (kube::Client, Handle) {
    let (service, handle) = mock::pair::<Request<Body>, Response<Body>>();
    (kube::Client::new(service, "apps"), handle)
}

/// The next request: method, path and JSON body (Null when there is none), answered with `reply`.
pub async fn expect(handle: &mut Handle, reply: serde_json::Value) -> (Method, String, serde_json::Value) {
    let (request, respond) = handle.next_request().await.expect("a request");
    let (method, path) = (request.method().clone(), request.uri().path().to_string());
    let bytes = request.into_body().collect_bytes().await.unwrap();
    let body = serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null);
    respond.send_response(Response::builder().body(Body::from(serde_json::to_vec(&reply).unwrap())).unwrap());
    (method, path, body)
}

/// The next request: method and path, refused as the API server refuses it (`code`, a `Status` with `reason` and
/// `message`).
pub async fn refuse(handle: &mut Handle, code: u16, reason: &str, message: &str) -> (Method, String) {
    let (request, respond) = handle.next_request().await.expect("a request");
    let (method, path) = (request.method().clone(), request.uri().path().to_string());
    let status = serde_json::json!({
        "kind": "Status", "apiVersion": "v1", "status": "Failure", "code": code, "reason": reason, "message": message,
    });
    let body = Body::from(serde_json::to_vec(&status).unwrap());
    respond.send_response(Response::builder().status(code).body(body).unwrap());
    (method, path)
}

/// Whether the client sent nothing within 100 ms.
pub async fn silent(handle: &mut Handle) -> bool {
    tokio::time::timeout(std::time::Duration::from_millis(100), handle.next_request()).await.is_err()
}
