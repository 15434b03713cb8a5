//! The accept loop: HTTP/1.1 connections with a header-read timeout (which also closes
//! connections idle before or between requests), a cap on open connections, and a graceful
//! drain on shutdown. (axum's own `serve` sets no timer, so it cannot time out slow headers,
//! and its HTTP-version sniffing waits without limit on a connection that sends nothing.)

use anyhow::Result;
use axum::Router;
use hyper::server::conn::http1::Builder;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};

#[derive(Debug, Clone, Copy)]
pub struct ConnLimits {
    pub header_read_timeout: Duration,
    pub max_connections: usize,
}

/// Serves `app` until `stop` turns true, then waits for open connections to finish their
/// requests (the caller bounds that wait with the shutdown grace).
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: ConnLimits,
    mut stop: watch::Receiver<bool>,
) -> Result<()> {
    let mut builder = Builder::new();
    builder.timer(TokioTimer::new()).header_read_timeout(limits.header_read_timeout);
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    let graceful = GracefulShutdown::new();
    loop {
        // At the cap, stop accepting until a connection closes.
        let permit = tokio::select! {
            p = slots.clone().acquire_owned() => p?,
            _ = stopped(&mut stop) => break,
        };
        let (tcp, _) = tokio::select! {
            r = listener.accept() => match r {
                Ok(conn) => conn,
                // Out of file descriptors and the like: back off instead of spinning.
                Err(e) => {
                    eprintln!("weft: accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = stopped(&mut stop) => break,
        };
        // Streams are many small writes: send each at once rather than waiting for ACKs.
        let _ = tcp.set_nodelay(true);
        let service = TowerToHyperService::new(app.clone());
        let conn = builder.serve_connection(TokioIo::new(tcp), service);
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            let _ = conn.await;
            drop(permit);
        });
    }
    drop(listener);
    graceful.shutdown().await;
    Ok(())
}

async fn stopped(stop: &mut watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await;
}
