//! An HTTP/1.1 proxy between an agent and a server that a test can break:
//! cut every connection (a network partition), and lose the answer to a
//! request after the server has handled it (the case an idempotency key is
//! for). One request at a time per connection, as the agent sends them;
//! bodies by `Content-Length`.

use std::{
    io::{BufRead, BufReader, Read, Write},
    net::{Shutdown, SocketAddr, TcpListener, TcpStream},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
};

struct State {
    /// Where new connections go.
    to: Mutex<SocketAddr>,
    /// While set, connections are refused and the open ones were closed.
    cut: AtomicBool,
    /// Every stream of an open connection, to close on a cut.
    open: Mutex<Vec<TcpStream>>,
    /// Requests that contain this (head or body) lose their answer, for
    /// `times` of them: the server handles them, the client gets a 503.
    lose: Mutex<Option<(String, usize)>>,
    /// Requests that contain it, answered by the server.
    answered: AtomicUsize,
    /// Requests whose first line contains the watched text, forwarded.
    watched: Mutex<Option<String>>,
    seen: AtomicUsize,
}

impl State {
    fn new(to: SocketAddr) -> Self {
        Self {
            to: Mutex::new(to),
            cut: AtomicBool::new(false),
            open: Mutex::default(),
            lose: Mutex::default(),
            answered: AtomicUsize::new(0),
            watched: Mutex::default(),
            seen: AtomicUsize::new(0),
        }
    }
}

pub struct Proxy {
    pub base: String,
    state: Arc<State>,
}

/// One HTTP message (head and body) read from `r`, or `None` at the end.
fn message(r: &mut BufReader<TcpStream>) -> Option<Vec<u8>> {
    let mut head = Vec::new();
    let mut length = 0usize;
    loop {
        let mut line = String::new();
        if r.read_line(&mut line).ok()? == 0 {
            return None;
        }
        if let Some((name, value)) = line.split_once(':')
            && name.eq_ignore_ascii_case("content-length")
        {
            length = value.trim().parse().ok()?;
        }
        head.extend_from_slice(line.as_bytes());
        if line == "\r\n" {
            break;
        }
    }
    let mut body = vec![0; length];
    r.read_exact(&mut body).ok()?;
    head.extend_from_slice(&body);
    Some(head)
}

impl Proxy {
    pub fn start(to: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let state = Arc::new(State::new(to));
        let st = state.clone();
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { continue };
                if st.cut.load(Ordering::SeqCst) {
                    let _ = client.shutdown(Shutdown::Both);
                    continue;
                }
                let to = *st.to.lock().unwrap();
                let Ok(server) = TcpStream::connect(to) else {
                    continue;
                };
                {
                    let mut open = st.open.lock().unwrap();
                    open.push(client.try_clone().unwrap());
                    open.push(server.try_clone().unwrap());
                }
                let st = st.clone();
                std::thread::spawn(move || Self::serve(&st, client, server));
            }
        });
        Self { base, state }
    }

    fn serve(st: &State, mut client: TcpStream, mut server: TcpStream) {
        let mut from_client = BufReader::new(client.try_clone().unwrap());
        let mut from_server = BufReader::new(server.try_clone().unwrap());
        while let Some(request) = message(&mut from_client) {
            let first = String::from_utf8_lossy(&request[..request.len().min(200)])
                .lines()
                .next()
                .unwrap_or_default()
                .to_owned();
            if st
                .watched
                .lock()
                .unwrap()
                .as_ref()
                .is_some_and(|w| first.contains(w.as_str()))
            {
                st.seen.fetch_add(1, Ordering::SeqCst);
            }
            if server.write_all(&request).is_err() {
                break;
            }
            let Some(answer) = message(&mut from_server) else {
                break;
            };
            let text = String::from_utf8_lossy(&request);
            let lose = {
                let mut lose = st.lose.lock().unwrap();
                if lose
                    .as_ref()
                    .is_some_and(|(what, _)| text.contains(what.as_str()))
                {
                    st.answered.fetch_add(1, Ordering::SeqCst);
                }
                match lose.as_mut() {
                    Some((what, left)) if *left > 0 && text.contains(what.as_str()) => {
                        *left -= 1;
                        true
                    }
                    _ => false,
                }
            };
            let sent = if lose {
                client.write_all(b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\n\r\n")
            } else {
                client.write_all(&answer)
            };
            if sent.is_err() {
                break;
            }
        }
        let _ = client.shutdown(Shutdown::Both);
        let _ = server.shutdown(Shutdown::Both);
    }

    /// Closes every connection through the proxy and refuses new ones: to
    /// the server as to the client, the other side is gone.
    pub fn cut(&self) {
        self.state.cut.store(true, Ordering::SeqCst);
        for s in self.state.open.lock().unwrap().drain(..) {
            let _ = s.shutdown(Shutdown::Both);
        }
    }

    /// Takes connections again.
    pub fn heal(&self) {
        self.state.cut.store(false, Ordering::SeqCst);
    }

    /// Sends connections to another server from now on (the open ones are
    /// cut, so the client reconnects there).
    pub fn retarget(&self, to: SocketAddr) {
        *self.state.to.lock().unwrap() = to;
        self.cut();
        self.heal();
    }

    /// The next `times` requests that contain `what` reach the server, and
    /// their client gets a 503 instead of its answer.
    pub fn lose_answers(&self, what: &str, times: usize) {
        *self.state.lose.lock().unwrap() = Some((what.to_owned(), times));
    }

    /// Counts the requests whose first line contains `what` from now on.
    pub fn watch(&self, what: &str) {
        *self.state.watched.lock().unwrap() = Some(what.to_owned());
        self.state.seen.store(0, Ordering::SeqCst);
    }

    pub fn seen(&self) -> usize {
        self.state.seen.load(Ordering::SeqCst)
    }

    /// How many requests that contain what `lose_answers` names the
    /// server has answered (whether their answer was then lost or not).
    pub fn answered(&self) -> usize {
        self.state.answered.load(Ordering::SeqCst)
    }
}
