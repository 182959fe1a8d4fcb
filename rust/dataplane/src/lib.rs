//! eldr-dataplane: the PD router's request path in Rust. A tokio/hyper server, started from
//! the PyO3 extension (as the SGLang gateway's is behind its Python `launch_router`), serves
//! /generate, /v1/completions and /v1/chat/completions with late binding (see [`flow`]) and
//! sends every other path to the Python control plane (admin endpoints, /metrics, /health).
//! It shares the core [`eldr_core::Router`] with Python: routing, the queue tracker, payload
//! decoding and hot reload (Python's reload thread swaps the centroids) are the core's.
//!
//! Modules: [`config`], [`server`] (accept loop), [`flow`] (the PD flow), [`upstream`]
//! (worker calls with timeouts), [`sse`] (the signature event), [`outlier`] (ejection),
//! [`counters`] (metrics), [`plane`] (shared state), [`errors`].

pub mod config;
pub mod counters;
pub mod errors;
pub mod flow;
pub mod outlier;
pub mod plane;
pub mod server;
pub mod sse;
pub mod upstream;

use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::Arc;

use eldr_core::Router;
use tokio::runtime::Runtime;
use tokio::sync::watch;

pub use config::{Config, Role};
pub use errors::ConfigError;
pub use plane::Plane;

/// A running (or not yet started) data plane.
pub struct DataPlane {
    plane: Arc<Plane>,
    runtime: Option<Runtime>,
    stop: Option<watch::Sender<bool>>,
    addr: Option<SocketAddr>,
}

impl DataPlane {
    pub fn new(cfg: Config, router: Arc<Router>) -> Result<Self, ConfigError> {
        Ok(DataPlane { plane: Arc::new(Plane::new(cfg, router)?), runtime: None, stop: None, addr: None })
    }

    pub fn plane(&self) -> &Arc<Plane> {
        &self.plane
    }

    /// Bind and serve on the data plane's own runtime threads; the bound port.
    pub fn start(&mut self) -> std::io::Result<u16> {
        if let Some(a) = self.addr {
            return Ok(a.port());
        }
        let cfg = &self.plane.cfg;
        let addr = (cfg.host.as_str(), cfg.port)
            .to_socket_addrs()?
            .next()
            .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::InvalidInput, format!("cannot resolve {}", cfg.host)))?;
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(cfg.threads).thread_name("eldr-dataplane").enable_all().build()?;
        let std_listener = bind(addr)?;
        let bound = std_listener.local_addr()?;
        let listener = {
            let _g = rt.enter();
            tokio::net::TcpListener::from_std(std_listener)?
        };
        let (tx, rx) = watch::channel(false);
        rt.spawn(server::serve(listener, Arc::clone(&self.plane), rx));
        self.runtime = Some(rt);
        self.stop = Some(tx);
        self.addr = Some(bound);
        Ok(bound.port())
    }

    /// Stop accepting, and end the requests in flight (their guards release their slots).
    pub fn stop(&mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(true);
        }
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_timeout(plane::SHUTDOWN_GRACE);
        }
        self.addr = None;
    }

    pub fn is_running(&self) -> bool {
        self.runtime.is_some()
    }
}

impl Drop for DataPlane {
    fn drop(&mut self) {
        self.stop();
    }
}

fn bind(addr: SocketAddr) -> std::io::Result<std::net::TcpListener> {
    let l = std::net::TcpListener::bind(addr)?;
    l.set_nonblocking(true)?;
    Ok(l)
}
