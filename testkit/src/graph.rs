//! The dependency graph of issue 43 ("Trust, third round", part 4), in
//! which one tenant's registrations made every dependency judge walk a
//! long chain: a chain of allocations, each task depending on the next
//! one, a target allocation whose tasks depend on the chain's head, and
//! fat dependents whose every task depends on every task of the target.
//! Shared by the tests (scaled down) and `taskgate-bench` (full size), so
//! both register the same shape.
//!
//! ```text
//!   dep-0 ─┐  (each task: one dependency on every task of the target)
//!   dep-1 ─┼─▶ target ──▶ chain-0/t0 → … → chain-0/tN ──▶ chain-1/t0 → … ──▶ chain-K/tN
//!   …     ─┘  (each task: on chain-0/t0)
//! ```

/// The sizes of the graph.
#[derive(Clone, Copy, Debug)]
pub struct Shape {
    /// Allocations of the chain.
    pub chain: usize,
    /// Tasks in each allocation of the chain.
    pub chain_tasks: usize,
    /// Tasks of the target (each dependent task depends on every one of
    /// them, so at most 16: a task's dependency limit).
    pub target_tasks: usize,
    /// Dependent allocations of the target.
    pub dependents: usize,
    /// Tasks in each dependent.
    pub dependent_tasks: usize,
}

impl Shape {
    /// The audit's graph: a chain of 960 tasks (four allocations of 240),
    /// a target of 16 tasks, and 8 dependents of 256 tasks, each task with
    /// 16 dependencies on the target.
    pub const FULL: Shape = Shape {
        chain: 4,
        chain_tasks: 240,
        target_tasks: 16,
        dependents: 8,
        dependent_tasks: 256,
    };

    /// The ID of chain allocation `k` (`{prefix}chain-{k}`).
    pub fn chain_id(prefix: &str, k: usize) -> String {
        format!("{prefix}chain-{k}")
    }

    /// The ID of the target.
    pub fn target_id(prefix: &str) -> String {
        format!("{prefix}target")
    }

    /// The ID of dependent `k`.
    pub fn dependent_id(prefix: &str, k: usize) -> String {
        format!("{prefix}dep-{k}")
    }

    /// Chain allocation `k`: task `t{i}` depends on `t{i+1}` running; the
    /// last on the next allocation's `t0` (none for the chain's tail).
    pub fn chain_spec(&self, prefix: &str, k: usize) -> String {
        let tasks: Vec<serde_json::Value> = (0..self.chain_tasks)
            .map(|i| {
                let dep = if i + 1 < self.chain_tasks {
                    Some(serde_json::json!({"task": format!("t{}", i + 1), "condition": "running"}))
                } else if k + 1 < self.chain {
                    Some(serde_json::json!({
                        "task": "t0",
                        "allocation": Self::chain_id(prefix, k + 1),
                        "condition": "running"
                    }))
                } else {
                    None
                };
                match dep {
                    Some(d) => serde_json::json!({"name": format!("t{i}"), "depends_on": [d]}),
                    None => serde_json::json!({"name": format!("t{i}")}),
                }
            })
            .collect();
        serde_json::json!({ "tasks": tasks }).to_string()
    }

    /// The target: every task depends on the chain's head.
    pub fn target_spec(&self, prefix: &str) -> String {
        let tasks: Vec<serde_json::Value> = (0..self.target_tasks)
            .map(|i| {
                serde_json::json!({"name": format!("t{i}"), "depends_on": [{
                    "task": "t0",
                    "allocation": Self::chain_id(prefix, 0),
                    "condition": "running"
                }]})
            })
            .collect();
        serde_json::json!({ "tasks": tasks }).to_string()
    }

    /// A dependent: every task depends on every task of the target.
    pub fn dependent_spec(&self, prefix: &str) -> String {
        let on: Vec<serde_json::Value> = (0..self.target_tasks.min(16))
            .map(|j| {
                serde_json::json!({
                    "task": format!("t{j}"),
                    "allocation": Self::target_id(prefix),
                    "condition": "running"
                })
            })
            .collect();
        let tasks: Vec<serde_json::Value> = (0..self.dependent_tasks)
            .map(|i| serde_json::json!({"name": format!("t{i}"), "depends_on": on}))
            .collect();
        serde_json::json!({ "tasks": tasks }).to_string()
    }

    /// Every registration, in an order the server accepts (each chain
    /// allocation after the one it depends on, so that no registration
    /// reaches an allocation not yet held): `(ID, spec)`.
    pub fn registrations(&self, prefix: &str) -> Vec<(String, String)> {
        let mut all: Vec<(String, String)> = (0..self.chain)
            .rev()
            .map(|k| (Self::chain_id(prefix, k), self.chain_spec(prefix, k)))
            .collect();
        all.push((Self::target_id(prefix), self.target_spec(prefix)));
        for k in 0..self.dependents {
            all.push((Self::dependent_id(prefix, k), self.dependent_spec(prefix)));
        }
        all
    }

    /// Dependencies on the target's tasks from the dependents.
    pub fn edges_on_target(&self) -> usize {
        self.dependents * self.dependent_tasks * self.target_tasks.min(16)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_full_shape_is_the_audits() {
        let s = Shape::FULL;
        assert_eq!(s.chain * s.chain_tasks, 960);
        assert_eq!(s.edges_on_target(), 8 * 256 * 16);
        let all = s.registrations("evil-");
        assert_eq!(all.len(), 4 + 1 + 8);
        assert_eq!(all[0].0, "evil-chain-3");
        assert_eq!(all[4].0, "evil-target");
        let dep: serde_json::Value = serde_json::from_str(&all[5].1).unwrap();
        assert_eq!(dep["tasks"].as_array().unwrap().len(), 256);
        assert_eq!(dep["tasks"][0]["depends_on"].as_array().unwrap().len(), 16);
        let head: serde_json::Value = serde_json::from_str(&all[3].1).unwrap();
        assert_eq!(
            head["tasks"][239]["depends_on"][0]["allocation"],
            "evil-chain-1"
        );
    }
}
