//! The feed: every published change in index order, for the event stream.
//!
//! The store's follower delivers changes in index order (`append`), and a
//! relisting starts afresh (`reset`); the feed's *frontier* is the index up
//! to which every change is known. An index a reader goes past is always
//! one the store holds, so a restart, which goes on from the highest index
//! the store holds, never hands it out again.
//!
//! The last `capacity` changes are kept, and no more than `budget` bytes of
//! their rendered lines (a change is rendered once, by its first reader,
//! and shared by every reader: an allocation view can be large, and a
//! stream of large changes must not hold thousands of them); a reader
//! further behind is told to list again (`Next::Resync`) instead of missing
//! changes silently, and so is a reader behind the index the feed started
//! at (it read another run of the server, before a restart) or ahead of the
//! frontier (it read another server, or a directory restored from a
//! backup), at once.

use std::{
    collections::VecDeque,
    sync::{Arc, Mutex, OnceLock, PoisonError, atomic::Ordering},
};

use tokio::sync::Notify;

use crate::lifecycle::{AllocId, Allocation};

/// One change as the stream tells it.
#[derive(Debug)]
pub struct Event {
    pub index: u64,
    pub alloc_id: AllocId,
    /// The allocation as committed at `index`, or `None`: deleted.
    pub allocation: Option<Arc<Allocation>>,
    /// The change rendered once for every reader (see `Feed::render`).
    rendered: OnceLock<bytes::Bytes>,
    /// Whether the feed keeps it (its rendered bytes count against the
    /// feed's budget while it does). Written under the feed's lock.
    kept: std::sync::atomic::AtomicBool,
}

impl Event {
    pub fn put(a: Arc<Allocation>) -> Self {
        Self::new(a.modify_index, a.id.clone(), Some(a))
    }

    pub fn deleted(alloc_id: AllocId, index: u64) -> Self {
        Self::new(index, alloc_id, None)
    }

    fn new(index: u64, alloc_id: AllocId, allocation: Option<Arc<Allocation>>) -> Self {
        Self {
            index,
            alloc_id,
            allocation,
            rendered: OnceLock::new(),
            kept: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// Its rendered bytes, if a reader rendered it.
    fn rendered_len(&self) -> usize {
        self.rendered.get().map_or(0, bytes::Bytes::len)
    }
}

/// What a reader gets next.
#[derive(Debug)]
pub enum Next {
    /// The reader's index is older than the oldest change kept: it must
    /// list again; the feed goes on from this index.
    Resync(u64),
    /// Changes after the reader's index, in index order (at least one).
    Changes(Vec<Arc<Event>>),
}

pub(crate) struct Feed {
    inner: Mutex<Inner>,
    /// Most bytes of rendered changes kept (see the module's comment).
    budget: usize,
    /// Woken when the frontier moves or the feed starts afresh.
    moved: Notify,
    capacity: usize,
}

struct Inner {
    /// Every change with an index in `(floor, frontier]` is in `kept`.
    floor: u64,
    frontier: u64,
    kept: VecDeque<Arc<Event>>,
    /// Bytes of rendered changes among `kept`.
    rendered: usize,
}

impl Feed {
    /// A feed that holds nothing before `index` (the store's last index
    /// when it was opened) and keeps up to `capacity` changes, of which at
    /// most `budget` bytes rendered.
    pub(crate) fn new(last: u64, capacity: usize, budget: usize) -> Self {
        Self {
            budget: budget.max(1),
            inner: Mutex::new(Inner {
                floor: last,
                frontier: last,
                kept: VecDeque::new(),
                rendered: 0,
            }),
            moved: Notify::new(),
            capacity: capacity.max(1),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The change as `render` writes it: rendered by the first reader to
    /// ask (outside the feed's lock) and shared with the others; its bytes
    /// count against the budget while the feed keeps it, and the oldest
    /// changes go when they are over it.
    pub(crate) fn render(
        &self,
        e: &Event,
        render: impl FnOnce(&Event) -> bytes::Bytes,
    ) -> bytes::Bytes {
        let mut first = false;
        let bytes = e
            .rendered
            .get_or_init(|| {
                first = true;
                render(e)
            })
            .clone();
        if first {
            let mut inner = self.lock();
            if e.kept.load(Ordering::Relaxed) {
                inner.rendered += bytes.len();
                inner.trim(self.capacity, self.budget);
            }
        }
        bytes
    }

    /// Bytes of rendered changes kept now.
    pub(crate) fn rendered_bytes(&self) -> usize {
        self.lock().rendered
    }

    /// Changes the store's follower delivers in index order, then
    /// everything up to `index` known.
    pub(crate) fn append(&self, events: Vec<Event>, index: u64) {
        let mut inner = self.lock();
        if index <= inner.frontier && events.is_empty() {
            return;
        }
        for event in events {
            if event.index > inner.frontier {
                inner.frontier = event.index;
                inner.keep(event, self.capacity, self.budget);
            }
        }
        inner.frontier = inner.frontier.max(index);
        drop(inner);
        self.moved.notify_waiters();
    }

    /// Starts afresh at `index` (the store's follower listed everything
    /// again: what happened before is not known one by one).
    pub(crate) fn reset(&self, index: u64) {
        let mut inner = self.lock();
        for e in inner.kept.drain(..) {
            e.kept.store(false, Ordering::Relaxed);
        }
        inner.rendered = 0;
        inner.floor = index.max(inner.frontier);
        inner.frontier = inner.floor;
        drop(inner);
        self.moved.notify_waiters();
    }

    /// What follows `after` now, up to `max` changes, whose IDs start with
    /// `prefix`; `None` if nothing does yet. `after` moves past what was
    /// looked at.
    pub(crate) fn read(&self, after: &mut u64, prefix: &str, max: usize) -> Option<Next> {
        let inner = self.lock();
        // Past the frontier: waiting would be silent, and whatever this
        // server does next could take indexes the reader has seen
        // elsewhere.
        if *after < inner.floor || *after > inner.frontier {
            *after = inner.frontier;
            return Some(Next::Resync(inner.frontier));
        }
        // `kept` is in index order: skip what the reader has seen.
        let start = inner.kept.partition_point(|e| e.index <= *after);
        let mut out = Vec::new();
        for e in inner.kept.range(start..) {
            *after = e.index;
            if e.alloc_id.as_str().starts_with(prefix) {
                out.push(e.clone());
                if out.len() == max {
                    break;
                }
            }
        }
        if out.len() < max {
            // Everything kept was looked at: the reader is at the frontier
            // (indexes without a change of its prefix, too).
            *after = (*after).max(inner.frontier);
        }
        (!out.is_empty()).then_some(Next::Changes(out))
    }

    /// Resolves once the feed has moved since it was enabled: enable it,
    /// then `read`, then await it, and no move is slept through.
    pub(crate) fn moved(&self) -> tokio::sync::futures::Notified<'_> {
        self.moved.notified()
    }

    /// The index up to which every change is known.
    pub(crate) fn frontier(&self) -> u64 {
        self.lock().frontier
    }
}

impl Inner {
    fn keep(&mut self, event: Event, capacity: usize, budget: usize) {
        event.kept.store(true, Ordering::Relaxed);
        self.rendered += event.rendered_len();
        self.kept.push_back(Arc::new(event));
        self.trim(capacity, budget);
    }

    /// Drops the oldest changes while more than `capacity` are kept or
    /// their rendered bytes are over `budget` (the newest stays, whatever
    /// its size: a reader can always be given the latest change).
    fn trim(&mut self, capacity: usize, budget: usize) {
        while self.kept.len() > capacity || (self.rendered > budget && self.kept.len() > 1) {
            let Some(old) = self.kept.pop_front() else {
                break;
            };
            old.kept.store(false, Ordering::Relaxed);
            self.rendered -= old.rendered_len();
            self.floor = old.index;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lifecycle::AllocId;

    fn feed(capacity: usize) -> Feed {
        Feed::new(10, capacity, usize::MAX)
    }

    /// Changes 11 to `to`, delivered one by one.
    fn deliver(feed: &Feed, to: u64, id: impl Fn(u64) -> String) {
        for n in 11..=to {
            let e = Event::deleted(AllocId::parse(&id(n)).unwrap(), n);
            feed.append(vec![e], n);
        }
    }

    fn deleted(i: u64) -> Event {
        Event::deleted(AllocId::parse(&format!("a{i}")).unwrap(), i)
    }

    fn indexes(next: Option<Next>) -> Vec<u64> {
        match next {
            Some(Next::Changes(v)) => v.iter().map(|e| e.index).collect(),
            Some(Next::Resync(i)) => panic!("resync at {i}"),
            None => Vec::new(),
        }
    }

    #[test]
    fn a_reader_ahead_of_the_frontier_is_told_to_resync_at_once() {
        let feed = feed(100);
        deliver(&feed, 11, |n| format!("a{n}"));
        // Another server's index, or one from before a restore: nothing
        // here will ever be told to it in order.
        let mut after = 50;
        assert!(matches!(
            feed.read(&mut after, "", 10),
            Some(Next::Resync(11))
        ));
        assert_eq!(after, 11);
        // At the frontier: the reader waits.
        assert!(feed.read(&mut after, "", 10).is_none());
        assert_eq!(after, 11);
    }

    #[test]
    fn a_reader_gets_each_change_once_filtered_and_in_batches() {
        let feed = feed(100);
        deliver(&feed, 15, |n| {
            format!("{}{n}", if n % 2 == 1 { "a" } else { "b" })
        });
        let mut after = 10;
        assert_eq!(indexes(feed.read(&mut after, "", 2)), [11, 12]);
        assert_eq!(indexes(feed.read(&mut after, "", 2)), [13, 14]);
        assert_eq!(indexes(feed.read(&mut after, "", 2)), [15]);
        assert!(feed.read(&mut after, "", 2).is_none());
        let mut after = 10;
        assert_eq!(indexes(feed.read(&mut after, "a", 10)), [11, 13, 15]);
        let mut after = 10;
        assert_eq!(indexes(feed.read(&mut after, "b", 10)), [12, 14]);
        // Nothing more for "b", but the reader is past all of it.
        assert_eq!(after, 15);
    }

    #[test]
    fn a_reader_behind_what_is_kept_is_told_to_resync() {
        let feed = feed(2);
        deliver(&feed, 14, |n| format!("a{n}"));
        // 13 and 14 are kept: a reader at 12 misses nothing.
        let mut after = 12;
        assert_eq!(indexes(feed.read(&mut after, "", 10)), [13, 14]);
        let mut after = 11;
        assert!(matches!(
            feed.read(&mut after, "", 10),
            Some(Next::Resync(14))
        ));
        assert_eq!(after, 14);
        // The follower's relisting: everyone behind it resyncs.
        feed.reset(20);
        let mut after = 14;
        assert!(matches!(
            feed.read(&mut after, "", 10),
            Some(Next::Resync(20))
        ));
        feed.append(vec![deleted(21)], 22);
        assert_eq!(indexes(feed.read(&mut after, "", 10)), [21]);
        assert_eq!(after, 22);
    }

    /// Through the registry and the disk store, with a restart between: a
    /// write the disk refused is never told to a reader, and moves no
    /// reader past an index a restart hands out again, so a reader that
    /// goes on from where it was gets the next change. A reader from
    /// before the restart's index is told to resync; one ahead of the
    /// server, at once.
    #[tokio::test]
    async fn a_refused_write_is_never_told_so_a_restart_cannot_hide_a_change() {
        use std::path::{Path, PathBuf};

        use crate::{
            lifecycle::{AllocSpec, Limits, TaskName, TaskSpec},
            registry::{Registry, RegistryConfig},
            store::{
                DiskStore, DiskStoreConfig, Store,
                fs::{Fs, sim},
            },
        };
        let dir = PathBuf::from("/sim/data");
        let open = |fs: &sim::SimFs| {
            let store = DiskStore::open(DiskStoreConfig {
                fs: Arc::new(fs.clone()),
                ..DiskStoreConfig::new(dir.clone())
            })
            .unwrap();
            let store: Arc<dyn Store> = Arc::new(store);
            Registry::open(store, RegistryConfig::default()).unwrap()
        };
        let spec = || {
            let task = TaskSpec {
                name: TaskName::parse("web").unwrap(),
                lifecycle: None,
                leader: false,
                readiness: false,
                liveness: None,
                depends_on: Vec::new(),
                acquire: Vec::new(),
                barrier: None,
            };
            AllocSpec::new(vec![task], &Limits::default()).unwrap()
        };
        let id = |s: &str| AllocId::parse(s).unwrap();
        let fs = sim::SimFs::new();
        fs.create_dir_all(&dir).unwrap();
        let r = open(&fs);
        r.register(id("a"), spec()).await.unwrap();
        r.register(id("b"), spec()).await.unwrap();
        // The disk refuses the next write: its commit fails.
        fs.fail_with(|op, path: &Path| {
            let log = path.to_string_lossy().contains("taskgate.wal.");
            (op == sim::Op::Write && log).then(|| std::io::Error::from_raw_os_error(5))
        });
        assert!(r.register(id("c"), spec()).await.is_err());
        let mut sub = r.subscribe(0, String::new()).unwrap();
        let Next::Changes(seen) = sub.next(10).await.unwrap() else {
            panic!("changes");
        };
        assert_eq!(seen.iter().map(|e| e.index).collect::<Vec<_>>(), [1, 2]);
        assert_eq!(sub.index(), 2, "not past the refused write's index");
        assert_eq!(r.stream_index(), 2);
        let listed_at = r.stream_index();
        drop((sub, r));
        fs.crash_now(1);
        let fs = sim::SimFs::from_image(&fs.image().unwrap());
        let r = open(&fs);
        r.register(id("d"), spec()).await.unwrap();
        assert_eq!(
            r.get("d").unwrap().modify_index,
            3,
            "the index is handed out again"
        );
        let mut sub = r.subscribe(listed_at, String::new()).unwrap();
        let Next::Changes(seen) = sub.next(10).await.unwrap() else {
            panic!("changes");
        };
        assert_eq!(seen[0].alloc_id.as_str(), "d");
        // Behind the restart, and ahead of the server.
        for from in [1, 4, 1000] {
            let mut sub = r.subscribe(from, String::new()).unwrap();
            assert!(
                matches!(sub.next(10).await.unwrap(), Next::Resync(3)),
                "from {from}"
            );
        }
    }

    #[test]
    fn a_change_is_rendered_once_for_every_reader_and_the_renders_kept_are_bounded() {
        // Room for two renders of 100 bytes.
        let feed = Feed::new(10, 100, 250);
        deliver(&feed, 15, |n| format!("a{n}"));
        let mut after = 10;
        let Some(Next::Changes(events)) = feed.read(&mut after, "", 10) else {
            panic!("five changes");
        };
        let renders = std::sync::atomic::AtomicUsize::new(0);
        let render = |_: &Event| {
            renders.fetch_add(1, Ordering::SeqCst);
            bytes::Bytes::from(vec![b'x'; 100])
        };
        let one = feed.render(&events[3], render);
        let two = feed.render(&events[3], render);
        assert_eq!(one.as_ptr(), two.as_ptr(), "one copy, shared");
        assert_eq!(renders.load(Ordering::SeqCst), 1);
        feed.render(&events[4], render);
        assert_eq!(feed.rendered_bytes(), 200);
        // A third render is over the budget: the oldest changes go, and a
        // reader behind them resyncs instead of missing them.
        feed.render(&events[2], render);
        assert!(feed.rendered_bytes() <= 250, "{}", feed.rendered_bytes());
        let mut behind = 10;
        assert!(matches!(
            feed.read(&mut behind, "", 10),
            Some(Next::Resync(15))
        ));
        // A render of a change the feed no longer keeps counts for nothing.
        let before = feed.rendered_bytes();
        feed.render(&events[0], render);
        assert_eq!(feed.rendered_bytes(), before);
    }
}
