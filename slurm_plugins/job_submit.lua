--[[
unicorn job_submit.lua  (JobSubmitPlugins=lua; Slurm reads it from slurm.conf's folder)

WHICH JOBS ARE UNICORN JOBS
  A batch job whose script carries the line
      #UNICORN-WRAPPER v1
  in its leading comment block, where sbatch reads #SBATCH directives (the unicorn
  sbatch wrapper has it). Chosen over a job name or comment, which users
  choose freely, can collide and override on the command line, and over the
  environment, which is inherited (an sbatch run inside a unicorn job would be caught).
  Every other job passes untouched, with one exception: a job that uses
  --unicorn-weight or --unicorn-min-gpus without the wrapper is rejected, because
  nothing would act on those options.

WHAT A UNICORN JOB MUST SATISFY (else it is rejected with a message saying why)
  - weight: --unicorn-weight (SPANK option, seen here in spank_job_env), else
    UNICORN_WEIGHT from the job's environment (e.g. --export): a plain decimal in
    [MIN_WEIGHT, MAX_WEIGHT] (the same grammar and bounds as unicorn_spank.c and
    unicorn_core.taskspec; a test compares them).
  - min_gpus: --unicorn-min-gpus, else UNICORN_MIN_GPUS: an integer in [1, MAX_MIN_GPUS].
  - requeue stays enabled: unicorn resizes and restarts a job by requeueing it.
    --no-requeue is rejected; unset becomes requeue=1.
  - --no-kill: a node failure must not kill the job (unicorn shrinks it instead).
    Slurm 22.05's Lua API cannot read kill_on_node_fail, so the script must carry
    "#SBATCH --no-kill" (or "#SBATCH -k"); a command-line "--no-kill=off" is not seen.

WHAT IS RECORDED
  admin_comment = unicorn:{"v":1,"weight":1.5,"min_gpus":4}
  (users cannot change admin_comment; no spaces, since `scontrol -o show job` output is
  split at spaces). A key that is absent takes unicornd's default. On modify, a unicorn
  job (recognised by that record) cannot have requeue disabled.
]]

local MIN_WEIGHT = 0.5
local MAX_WEIGHT = 2.0
local MAX_MIN_GPUS = 1000000
local MAX_ARG_LEN = 16
local WRAPPER_VERSION = "1"
local RECORD_PREFIX = "unicorn:"
-- How Slurm passes a SPANK option of plugin "unicorn" to the controller ('-' -> '_').
local SPANK_OPTION_PREFIX = "_SLURM_SPANK_OPTION_unicorn_"
local NO_VAL16 = 65534

-- The script's leading comment block, line by line: sbatch reads #SBATCH directives only
-- up to the first line that is neither blank nor a comment, and so does this file.
local function header_lines(script)
   local out = {}
   for line in string.gmatch(script .. "\n", "([^\n]*)\n") do
      if string.match(line, "^%s*[^#%s]") then
         break
      end
      table.insert(out, line)
   end
   return out
end

-- "1" for "#UNICORN-WRAPPER v1", the version text for another version, nil without marker.
local function wrapper_version(header)
   for _, line in ipairs(header) do
      local version = string.match(line, "^#UNICORN%-WRAPPER%s+v(%S+)%s*$")
      if version ~= nil then
         return version
      end
   end
   return nil
end

local function has_no_kill_directive(header)
   for _, line in ipairs(header) do
      local args = string.match(line, "^#SBATCH%s+(.*)$")
      if args ~= nil then
         for token in string.gmatch(args, "%S+") do
            if token == "--no-kill" or token == "-k" then
               return true
            end
         end
      end
   end
   return false
end

-- The unicorn SPANK options the submitter used: { weight = "1.5", min_gpus = "4" }.
local function spank_options(job_desc)
   local found = {}
   local env = job_desc.spank_job_env
   if env == nil then
      return found
   end
   for _, entry in pairs(env) do
      local name, value = string.match(entry, "^" .. SPANK_OPTION_PREFIX .. "unicorn_([%w_]+)=(.*)$")
      if name ~= nil then
         found[name] = value
      end
   end
   return found
end

local function env_value(job_desc, name)
   local env = job_desc.environment
   if env == nil then
      return nil
   end
   return env[name]
end

local function plain_decimal(text, allow_dot)
   if text == nil or #text == 0 or #text > MAX_ARG_LEN then
      return false
   end
   local pattern = allow_dot and "^%d*%.?%d*$" or "^%d+$"
   return string.match(text, pattern) ~= nil and string.match(text, "%d") ~= nil
end

-- Returns the weight as a number, or nil and the reason.
local function check_weight(text, source)
   local weight = plain_decimal(text, true) and tonumber(text) or nil
   if weight == nil or weight < MIN_WEIGHT or weight > MAX_WEIGHT then
      return nil, string.format("unicorn: %s=%s: the weight must be a decimal number between %.1f and %.1f",
                                source, text, MIN_WEIGHT, MAX_WEIGHT)
   end
   return weight
end

local function check_min_gpus(text, source)
   local n = plain_decimal(text, false) and tonumber(text) or nil
   if n == nil or n < 1 or n > MAX_MIN_GPUS then
      return nil, string.format("unicorn: %s=%s: min GPUs must be an integer between 1 and %d",
                                source, text, MAX_MIN_GPUS)
   end
   return n
end

local function reject(message)
   slurm.log_user(message)
   slurm.log_info("job_submit.lua: rejected: %s", message)
   return slurm.ERROR
end

function slurm_job_submit(job_desc, part_list, submit_uid)
   local options = spank_options(job_desc)
   local header = job_desc.script and header_lines(job_desc.script) or {}
   local version = wrapper_version(header)
   if version == nil then
      if options.weight ~= nil or options.min_gpus ~= nil then
         return reject("unicorn: --unicorn-weight/--unicorn-min-gpus need the unicorn wrapper script "
                       .. "(sbatch [options] <wrapper> -- <training command>); this job is not one")
      end
      return slurm.SUCCESS
   end
   if version ~= WRAPPER_VERSION then
      return reject(string.format("unicorn: wrapper version v%s is not known here (this cluster accepts v%s); "
                                  .. "use the wrapper installed with this cluster", version, WRAPPER_VERSION))
   end

   local record = { '"v":1' }
   local weight_text, weight_source = options.weight, "--unicorn-weight"
   if weight_text == nil then
      weight_text, weight_source = env_value(job_desc, "UNICORN_WEIGHT"), "UNICORN_WEIGHT"
   end
   if weight_text ~= nil then
      local weight, err = check_weight(weight_text, weight_source)
      if weight == nil then
         return reject(err)
      end
      table.insert(record, string.format('"weight":%.6g', weight))
   end
   local gpus_text, gpus_source = options.min_gpus, "--unicorn-min-gpus"
   if gpus_text == nil then
      gpus_text, gpus_source = env_value(job_desc, "UNICORN_MIN_GPUS"), "UNICORN_MIN_GPUS"
   end
   if gpus_text ~= nil then
      local min_gpus, err = check_min_gpus(gpus_text, gpus_source)
      if min_gpus == nil then
         return reject(err)
      end
      table.insert(record, string.format('"min_gpus":%d', min_gpus))
   end

   if job_desc.requeue == 0 then
      return reject("unicorn: a unicorn job must stay requeueable (unicorn resizes jobs by requeueing "
                    .. "them); drop --no-requeue")
   end
   if not has_no_kill_directive(header) then
      return reject("unicorn: the wrapper script must carry '#SBATCH --no-kill' (a node failure must not "
                    .. "kill the job; unicorn shrinks it instead)")
   end
   if job_desc.requeue == NO_VAL16 then
      job_desc.requeue = 1
   end
   job_desc.admin_comment = RECORD_PREFIX .. "{" .. table.concat(record, ",") .. "}"
   slurm.log_info("job_submit.lua: unicorn job %s of uid %d: %s", tostring(job_desc.name), submit_uid,
                  job_desc.admin_comment)
   return slurm.SUCCESS
end

function slurm_job_modify(job_desc, job_rec, part_list, modify_uid)
   local recorded = job_rec.admin_comment
   if recorded ~= nil and string.sub(recorded, 1, #RECORD_PREFIX) == RECORD_PREFIX and job_desc.requeue == 0 then
      slurm.log_user("unicorn: a unicorn job must stay requeueable (unicorn resizes jobs by requeueing them)")
      return slurm.ERROR
   end
   return slurm.SUCCESS
end
