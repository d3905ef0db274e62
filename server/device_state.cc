// The service's side of executors that hold state and of GPU transports
// (executor.h, device_transport.h): host mirrors of device-resident momentum
// are filled before they are read and pushed back after they are written.

#include "absl/strings/str_cat.h"
#include "server/job.h"
#include "server/param_work.h"
#include "server/service.h"

namespace dmuon::server {

absl::Status OptimizerService::PullStateLocked(Job& job) {
  if (!scheduler_->holds_state()) return absl::OkStatus();
  for (size_t i = 0; i < job.params.size(); ++i) {
    std::vector<float>& m = job.params[i].momentum;
    if (m.empty()) m.assign(job.table.params[i].shape.elements(), 0.0f);
    const StateKey key{job.serial, static_cast<int32_t>(i)};
    if (auto st = scheduler_->ReadState(job.plan.executor_of[i], key,
                                        absl::MakeSpan(m));
        !st.ok()) {
      return absl::Status(st.code(),
                          absl::StrCat("reading the momentum of parameter '",
                                       job.table.params[i].name, "' of job '",
                                       job.id, "': ", st.message()));
    }
  }
  return absl::OkStatus();
}

absl::Status OptimizerService::PushStateLocked(Job& job) {
  if (!scheduler_->holds_state()) return absl::OkStatus();
  for (size_t i = 0; i < job.params.size(); ++i) {
    const std::vector<float>& m = job.params[i].momentum;
    if (m.empty()) continue;
    const StateKey key{job.serial, static_cast<int32_t>(i)};
    if (auto st = scheduler_->WriteState(job.plan.executor_of[i], key,
                                         absl::MakeConstSpan(m));
        !st.ok()) {
      return absl::Status(st.code(),
                          absl::StrCat("writing the momentum of parameter '",
                                       job.table.params[i].name, "' of job '",
                                       job.id, "': ", st.message()));
    }
  }
  return absl::OkStatus();
}

void OptimizerService::PullDone(const std::shared_ptr<Job>& job,
                                const std::weak_ptr<Session>& session,
                                int64_t step, const std::vector<int>& ids,
                                const absl::Status& status) {
  if (!status.ok()) return TransferFailed(job, status);
  std::vector<std::shared_ptr<ParamWork>> ready;
  {
    std::lock_guard<std::mutex> lock(job->mu);
    // The job's own reference (its ranks), if the session is still open.
    Session* s = nullptr;
    for (const auto& r : job->ranks) {
      if (r && !r.owner_before(session) && !session.owner_before(r))
        s = r.get();
    }
    if (s == nullptr || s->closed || job->broken) return;
    const bool complete = job->open_ranks() == job->world_size;
    for (int id : ids) {
      s->bytes_in += s->layout.slots[id].bytes;
      if (metrics_) metrics_->BytesReceived(s->layout.slots[id].bytes);
      ParamState& p = job->params[id];
      p.arrived[s->rank] = 1;
      if (++p.arrived_count == job->world_size && complete) {
        p.running = true;
        ready.push_back(std::make_shared<ParamWork>(this, job, id, step));
      }
    }
  }
  for (auto& w : ready) {
    const int executor = job->plan.executor_of[w->param];
    scheduler_->Submit(executor, std::move(w));
  }
}

void OptimizerService::TransferFailed(const std::shared_ptr<Job>& job,
                                      const absl::Status& status) {
  std::lock_guard<std::mutex> lock(job->mu);
  if (job->broken) return;
  job->broken = true;
  const absl::Status why(status.code(),
                         absl::StrCat("job '", job->id, "': ", status.message(),
                                      "; reopen every rank and restore state "
                                      "from a checkpoint"));
  for (auto& s : job->ranks)
    if (s && s->sink) s->sink->Abort(why);
  CountError(why);
}

bool OptimizerService::DeviceTransportAvailable(v1::Transport t) const {
  return options_.device_transports != nullptr &&
         options_.device_transports->Supports(t) &&
         scheduler_->reads_device_memory();
}

}  // namespace dmuon::server
