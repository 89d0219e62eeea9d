//! A TCP forwarder in front of one etcd member that a test can stall: while
//! stalled, what the client sends still reaches the member (which applies
//! it) and nothing the member answers comes back, as when the member, or
//! the network on the way back, pauses. Protocol-blind (gRPC over HTTP/2
//! passes through as bytes).

use std::{
    io::{Read, Write},
    net::{Shutdown, SocketAddr, TcpListener, TcpStream},
    sync::{Arc, Condvar, Mutex},
};

#[derive(Default)]
struct Gate {
    stalled: Mutex<bool>,
    changed: Condvar,
}

impl Gate {
    /// Blocks while stalled.
    fn pass(&self) {
        let mut stalled = self.stalled.lock().unwrap();
        while *stalled {
            stalled = self.changed.wait(stalled).unwrap();
        }
    }
}

pub struct Stall {
    /// The URL to give the client (`http://127.0.0.1:port`).
    pub url: String,
    gate: Arc<Gate>,
}

fn pump(mut from: TcpStream, mut to: TcpStream, gate: Option<Arc<Gate>>) {
    let mut buf = vec![0; 64 * 1024];
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if let Some(gate) = &gate {
            gate.pass();
        }
        if to.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    let _ = to.shutdown(Shutdown::Both);
    let _ = from.shutdown(Shutdown::Both);
}

impl Stall {
    /// Forwards every connection to `member` (a `http://host:port` URL).
    pub fn start(member: &str) -> Self {
        let to: SocketAddr = member
            .trim_start_matches("http://")
            .parse()
            .expect("a loopback member URL");
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let gate = Arc::new(Gate::default());
        let g = gate.clone();
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { continue };
                let Ok(server) = TcpStream::connect(to) else {
                    continue;
                };
                let (c, s) = (client.try_clone().unwrap(), server.try_clone().unwrap());
                std::thread::spawn(move || pump(c, s, None));
                let g = g.clone();
                std::thread::spawn(move || pump(server, client, Some(g)));
            }
        });
        Self { url, gate }
    }

    /// From now on the member's answers are held back.
    pub fn stall(&self) {
        *self.gate.stalled.lock().unwrap() = true;
    }

    /// The held answers, and all later ones, flow again.
    pub fn release(&self) {
        *self.gate.stalled.lock().unwrap() = false;
        self.gate.changed.notify_all();
    }
}

impl Drop for Stall {
    fn drop(&mut self) {
        self.release();
    }
}
