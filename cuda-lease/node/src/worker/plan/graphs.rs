//! Planning graphs: a body recorded between `GraphBegin` and `GraphEnd`,
//! its launches and its free, and the rule that keeps what a live graph
//! uses alive.

use super::super::objects::{GraphIds, IdKind, Io};
use super::{Effect, GraphChange, Planner, Refusal, Step};
use crate::proto::{Command, Id, Role, Status};

/// Refuses a `GraphBegin` at `i` whose body does not end in the batch
/// (nothing of it would run; its allocations would be unreachable).
pub(super) fn body_ends(commands: &[Command<'_>], i: usize) -> Result<(), Refusal> {
    let Role::Begin { id: graph, .. } = commands[i].op.role() else {
        return Ok(());
    };
    let ends = commands[i + 1..]
        .iter()
        .any(|c| c.op.role() == Role::End(graph));
    if ends {
        Ok(())
    } else {
        Err((
            Status::BadRequest,
            format!("the body of graph {graph} does not end in its batch"),
        ))
    }
}

impl Planner<'_> {
    /// A live graph's holdings, after the commands planned so far.
    fn graph(&self, id: Id) -> Option<&GraphIds> {
        match self.graph_overlay.get(&id) {
            Some(g) => g.as_ref(),
            None => self.state.graphs.get(&id),
        }
    }

    /// What a live prepared submission writes and reads at each run
    /// (`None` for a graph).
    fn io_of(&self, id: Id) -> Option<Io> {
        self.graph(id)?.prepared
    }

    /// The live graph that uses `id`, if one does.
    fn user_of(&self, id: Id) -> Option<Id> {
        let batch = self
            .graph_overlay
            .iter()
            .filter_map(|(g, ids)| Some((*g, ids.as_ref()?)));
        let earlier = self
            .state
            .graphs
            .iter()
            .filter(|(g, _)| !self.graph_overlay.contains_key(g))
            .map(|(g, ids)| (*g, ids));
        batch
            .chain(earlier)
            .find(|(_, ids)| ids.uses.contains(&id))
            .map(|(g, _)| g)
    }

    /// Plans `c` (command `i`) when graphs decide it: `Some` for a command
    /// planned here, `None` for one the ordinary step plans (a body's
    /// command is noted as a use of the graph first).
    pub(super) fn graph_step(
        &mut self,
        i: usize,
        c: &Command<'_>,
    ) -> Result<Option<Step>, Refusal> {
        if let Some((graph, mut ids)) = self.open.take() {
            let step = self.body_step(i, c, graph, &mut ids);
            if c.op.role() != Role::End(graph) || step.is_err() {
                self.open = Some((graph, ids));
            }
            return step;
        }
        match c.op.role() {
            Role::Begin {
                id: graph,
                prepared,
            } => {
                self.fresh(graph)?;
                let prepared = prepared.then(Io::default);
                let ids = GraphIds {
                    prepared,
                    ..GraphIds::default()
                };
                self.open = Some((graph, ids));
                Ok(Some(Step::effect(Effect::Create(graph, IdKind::Graph))))
            }
            Role::End(graph) => Err((
                Status::BadRequest,
                format!("graph {graph} has no body being recorded"),
            )),
            Role::Launch(graph) => match self.kind(graph) {
                Some(IdKind::Graph) if self.io_of(graph).is_some() => Err((
                    Status::BadRequest,
                    format!("{graph} is a prepared submission: run it with Run"),
                )),
                Some(IdKind::Graph) => Ok(Some(Step::effect(Effect::None))),
                Some(_) => Err((Status::BadRequest, format!("{graph} is not a graph"))),
                None => Err((Status::NotFound, format!("unknown id {graph}"))),
            },
            Role::Run {
                id: prepared,
                inputs,
                outputs,
            } => {
                let io = match self.kind(prepared) {
                    Some(IdKind::Graph) => self.io_of(prepared).ok_or_else(|| {
                        let m = format!("{prepared} is a graph: launch it with GraphLaunch");
                        (Status::BadRequest, m)
                    })?,
                    Some(k) => {
                        let m = format!("{prepared} is {}, not a prepared submission", k.noun());
                        return Err((Status::BadRequest, m));
                    }
                    None => return Err((Status::NotFound, format!("unknown id {prepared}"))),
                };
                if (inputs, outputs) != (io.inputs, io.outputs) {
                    return Err((
                        Status::BadRequest,
                        format!(
                            "prepared submission {prepared} writes {} bytes and reads {}; the \
                             run gives {inputs} and asks {outputs}",
                            io.inputs, io.outputs
                        ),
                    ));
                }
                self.reply_bytes(outputs)?;
                Ok(Some(Step::effect(Effect::None)))
            }
            Role::Free(id) if self.kind(id) == Some(IdKind::Graph) => {
                // Its body's frees run with it.
                let frees = self.graph(id).map(|g| g.frees.clone()).unwrap_or_default();
                for f in frees {
                    self.apply(Effect::Free(f), c.stream);
                }
                self.graph_overlay.insert(id, None);
                self.graph_changes.push((i, GraphChange::Freed(id)));
                Ok(Some(Step::effect(Effect::Free(id))))
            }
            Role::Free(id) => match self.user_of(id) {
                Some(g) => Err((
                    Status::BadRequest,
                    format!("{id} is used by graph {g}: free the graph first"),
                )),
                None => Ok(None),
            },
            Role::Alloc { .. } | Role::Write { .. } | Role::Read { .. } | Role::Plain => Ok(None),
        }
    }

    /// [`Planner::graph_step`] for a command of `graph`'s body; the body
    /// ends when this returns `Ok` for its `GraphEnd`.
    fn body_step(
        &mut self,
        i: usize,
        c: &Command<'_>,
        graph: Id,
        ids: &mut GraphIds,
    ) -> Result<Option<Step>, Refusal> {
        let refuse = |what: &str| {
            Err((
                Status::BadRequest,
                format!("the body of graph {graph} cannot {what}"),
            ))
        };
        // What a body may hold: the client's rule too.
        if let Err(not) = c.op.allowed_in_body(ids.prepared.is_some()) {
            return refuse(not.what());
        }
        match c.op.role() {
            // A prepared body's (the rule refused a graph's): each run's
            // reply takes its bytes.
            Role::Read { buf, offset, len } => {
                super::in_range(self.buffer(buf)?, offset, len)?;
                if let Some(io) = &mut ids.prepared {
                    io.outputs = io.outputs.saturating_add(len);
                    if io.outputs > self.limits.max_read {
                        return Err((
                            Status::BadRequest,
                            "the body's reads exceed the reply data limit".into(),
                        ));
                    }
                }
                ids.uses.insert(buf);
                Ok(Some(Step::effect(Effect::None)))
            }
            // A prepared body's bytes come with each run; a graph keeps its own.
            Role::Write { len, .. } => {
                match &mut ids.prepared {
                    Some(io) => io.inputs = io.inputs.saturating_add(len),
                    None => ids.kept += len,
                }
                c.op.for_each_id(|id| {
                    ids.uses.insert(id);
                });
                Ok(None)
            }
            Role::End(g) if g == graph => {
                self.charges.alloc(ids.kept)?;
                self.graph_overlay.insert(graph, Some(ids.clone()));
                self.graph_changes
                    .push((i, GraphChange::Made(graph, ids.clone())));
                Ok(Some(Step::effect(Effect::None)))
            }
            Role::End(g) => Err((
                Status::BadRequest,
                format!("{g} is not the graph being recorded ({graph})"),
            )),
            // Runs with the graph's own free.
            Role::Free(id) if id == graph => refuse("free itself"),
            Role::Free(id) => {
                if self.kind(id).is_none() {
                    return Err((Status::NotFound, format!("unknown id {id}")));
                }
                ids.frees.push(id);
                Ok(Some(Step::effect(Effect::None)))
            }
            // Kept for each launch or run; what the rule refused above
            // (timers, nested bodies, launches, cuRAND fills) never gets here.
            Role::Alloc { .. }
            | Role::Begin { .. }
            | Role::Launch(_)
            | Role::Run { .. }
            | Role::Plain => {
                c.op.for_each_id(|id| {
                    ids.uses.insert(id);
                });
                Ok(None)
            }
        }
    }
}
